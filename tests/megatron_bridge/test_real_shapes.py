"""The bridge at the real sizes of the target models (Llama-3.1-405B, Qwen3-8B, Qwen3-30B-A3B, DeepSeek-V3,
GLM-4.5), on the meta device: the Megatron GPTModel built from each config.json has exactly one rule per weight,
the rules name exactly the tensors transformers builds for that config, every rule's HF shapes fuse into its
Megatron parameter's shape and split back, and both models count the same parameters. The tiny-model tests check
the numbers; this one checks that head counts, group sizes, expert counts and widths of the real models map."""

from __future__ import annotations

import pytest
import torch

from slimish.megatron_bridge import dense
from slimish.megatron_bridge.hf_config import architecture_from_hf
from slimish.megatron_bridge.hf_shapes import expected_hf_shapes
from tests.megatron_bridge.real_configs import REAL_CONFIGS, trimmed

# Parameters of the whole model (untrimmed), as its model card states them, to the stated precision.
BILLIONS = {"llama31_405b": (405.85, 0.01), "qwen3_8b": (8.19, 0.01)}


def megatron_meta_shapes(arch) -> dict[str, tuple[int, ...]]:
    from slimish.trainer.model import build_gpt_model

    with torch.device("meta"):
        model = build_gpt_model(arch, tensor_parallel=1, pipeline_parallel=1)
    shapes = {dense.canonical_megatron_name(n): tuple(p.shape) for n, p in model.named_parameters()}
    shapes.update({n: tuple(b.shape) for n, b in model.named_buffers() if n.endswith("router.expert_bias")})
    return shapes


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_real_config_maps_every_tensor_at_its_shape(name, megatron_world):
    cfg = trimmed(name)
    arch = architecture_from_hf(cfg)
    hf = expected_hf_shapes(cfg)
    megatron = megatron_meta_shapes(arch)
    rules = dense.model_rules(arch)
    assert {r.megatron for r in rules} == set(megatron), "one rule per Megatron weight"
    assert sorted(n for r in rules for n in r.hf) == sorted(hf), "the rules name exactly transformers' tensors"
    for rule in rules:
        hf_tensors = [torch.empty(hf[n], device="meta") for n in rule.hf]
        fused = dense.to_megatron(rule, hf_tensors, arch)
        assert tuple(fused.shape) == megatron[rule.megatron] == dense.megatron_shape(rule, [hf[n] for n in rule.hf])
        assert [tuple(t.shape) for t in dense.to_hf(rule, fused, arch)] == [hf[n] for n in rule.hf], rule.megatron
    count = sum(torch.Size(s).numel() for s in megatron.values())
    assert count == sum(torch.Size(s).numel() for s in hf.values())
    if name in BILLIONS:
        billions, precision = BILLIONS[name]
        assert abs(count / 1e9 - billions) < precision, f"{name}: {count:,} parameters"


def test_real_moe_configs_route_as_released():
    qwen = architecture_from_hf(REAL_CONFIGS["qwen3_30b_a3b"]).moe
    assert (qwen.num_experts, qwen.topk, qwen.ffn_hidden_size, set(qwen.layer_pattern)) == (128, 8, 768, {1})
    deepseek = architecture_from_hf(REAL_CONFIGS["deepseek_v3"])
    assert deepseek.moe.layer_pattern == (0, 0, 0) + (1,) * 58 and deepseek.mtp_layers == 1
    assert (deepseek.moe.num_groups, deepseek.moe.group_topk, deepseek.moe.scaling_factor) == (8, 4, 2.5)
    assert (deepseek.mla.q_lora_rank, deepseek.mla.kv_lora_rank, deepseek.mla.rope_type) == (1536, 512, "yarn")
    glm = architecture_from_hf(REAL_CONFIGS["glm45"])
    assert glm.moe.layer_pattern == (0, 0, 0) + (1,) * 89 and glm.moe.shared_ffn_hidden_size == 1536
    assert (glm.rotary_percent, glm.add_qkv_bias, glm.qk_layernorm) == (0.5, True, True)
