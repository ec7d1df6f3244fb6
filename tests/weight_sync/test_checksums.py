"""The sender's prediction of SGLang's per-parameter checksums, without an engine (the e2e test in
tests/e2e/test_weight_sync_engines.py compares it with real engines): fused parameters hash as the concatenation of
their parts whatever order the parts arrive in, the vocabulary is padded with zero rows, and a missing part is an
error rather than a silently unchecked parameter."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from slimish.weight_sync.checksums import ExpectedChecksums, differing, tensor_checksum


def arch(num_experts: int = 0):
    return SimpleNamespace(mla=None, moe=SimpleNamespace(num_experts=num_experts) if num_experts else None)


def moe_layer(num_experts: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.0.self_attn.{p}_proj.weight": torch.randn(4, 8, generator=g) for p in "qkv"}
    tensors["model.layers.0.input_layernorm.weight"] = torch.randn(8, generator=g)
    for e in range(num_experts):
        for proj in ("gate", "up", "down"):
            tensors[f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight"] = torch.randn(6, 8, generator=g)
    for proj in ("gate", "up"):
        tensors[f"model.layers.0.mlp.shared_experts.{proj}_proj.weight"] = torch.randn(6, 8, generator=g)
    return tensors


def engine_params(t: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """The fused tensors as SGLang holds them."""
    p = "model.layers.0"
    return {
        f"{p}.self_attn.qkv_proj.weight": torch.cat([t[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"]),
        f"{p}.input_layernorm.weight": t[f"{p}.input_layernorm.weight"],
        f"{p}.mlp.experts.w13_weight": torch.stack([torch.cat([t[f"{p}.mlp.experts.{e}.gate_proj.weight"],
                                                               t[f"{p}.mlp.experts.{e}.up_proj.weight"]])
                                                    for e in range(num_experts)]),
        f"{p}.mlp.experts.w2_weight": torch.stack([t[f"{p}.mlp.experts.{e}.down_proj.weight"]
                                                   for e in range(num_experts)]),
        f"{p}.mlp.shared_experts.gate_up_proj.weight": torch.cat([t[f"{p}.mlp.shared_experts.gate_proj.weight"],
                                                                  t[f"{p}.mlp.shared_experts.up_proj.weight"]]),
    }


@pytest.mark.parametrize("shuffled", [False, True])
def test_fused_parameters_hash_as_their_concatenation_in_any_arrival_order(shuffled):
    tensors = moe_layer(num_experts=3)
    items = list(tensors.items())
    if shuffled:
        random.Random(1).shuffle(items)
    expected = ExpectedChecksums(arch(3), torch.float32)
    for name, tensor in items:
        expected.add(name, tensor)
    truth = {name: tensor_checksum(t) for name, t in engine_params(tensors, 3).items()}
    assert expected.result() == truth


def test_checksums_are_of_the_engine_dtype():
    t = torch.randn(5, 3)
    expected = ExpectedChecksums(arch(), torch.bfloat16)
    expected.add("model.norm.weight", t)
    assert expected.result() == {"model.norm.weight": tensor_checksum(t.to(torch.bfloat16))}


def test_the_vocabulary_is_padded_with_zero_rows_to_a_multiple_of_64():
    embed = torch.randn(70, 4)
    expected = ExpectedChecksums(arch(), torch.float32)
    expected.add("model.embed_tokens.weight", embed)
    padded = torch.cat([embed, torch.zeros(58, 4)])
    assert expected.result() == {"model.embed_tokens.weight": tensor_checksum(padded)}


def test_a_fused_parameter_missing_a_part_is_an_error():
    expected = ExpectedChecksums(arch(), torch.float32)
    expected.add("model.layers.0.self_attn.q_proj.weight", torch.ones(2, 2))
    expected.add("model.layers.0.self_attn.v_proj.weight", torch.ones(2, 2))
    with pytest.raises(RuntimeError, match=r"qkv_proj.weight': '2/3 parts'"):
        expected.result()


def test_differing_names_both_sides():
    assert differing({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "x", "d": "4"}) == \
        ["b", "c (not on the engine)", "d (not sent)"]


def test_the_cpu_checksum_is_sglangs():
    """Same value as SGLang's own function (importing SGLang takes ~10 s, so this is the only test that does)."""
    tensor_hash = pytest.importorskip("sglang.srt.managers.mm_utils").tensor_hash
    t = torch.randn(3, 5).to(torch.bfloat16)
    assert tensor_checksum(t) == f"{tensor_hash(t):016x}"
