"""The sender's prediction of SGLang's per-parameter checksums, without an engine (the e2e test in
tests/e2e/test_weight_sync_engines.py compares it with real engines, of one and of two ranks): fused parameters hash
as the concatenation of their parts whatever order the parts arrive in, the vocabulary is padded with zero rows, and
a missing part is an error rather than a silently unchecked parameter. On engines of several ranks: each rank's
slices, by the rules SGLang applies (written out by hand here, from SGLang's loaders)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from slimish.weight_sync.checksums import (
    SHA256,
    TILE,
    EngineSharding,
    ExpectedChecksums,
    differing,
    fuses_shared_experts,
    hash_kind,
    layout_supported,
    merged,
    tensor_checksum,
)
from slimish.weight_sync.engine_loader import slot_name
from slimish.weight_sync.tile_hash import TileHash, tile_hash


def arch(num_experts: int = 0, heads: int = 4, kv_heads: int = 2, family: str = "qwen3_moe", shared: int | None = None,
         mla=None):
    moe = SimpleNamespace(num_experts=num_experts, ffn_hidden_size=6, shared_ffn_hidden_size=shared)
    return SimpleNamespace(family=family, mla=mla, moe=moe if num_experts else None, num_attention_heads=heads,
                           num_query_groups=kv_heads)


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
        **({f"{p}.mlp.shared_experts.gate_up_proj.weight": torch.cat([t[f"{p}.mlp.shared_experts.gate_proj.weight"],
                                                                     t[f"{p}.mlp.shared_experts.up_proj.weight"]])}
           if f"{p}.mlp.shared_experts.gate_proj.weight" in t else {}),
    }


def moe_layer_items(shuffled: bool) -> tuple[dict, list]:
    """A three-expert MoE layer's tensors, and their (name, tensor) items in model order or shuffled."""
    tensors = moe_layer(num_experts=3)
    items = list(tensors.items())
    if shuffled:
        random.Random(1).shuffle(items)
    return tensors, items


@pytest.mark.parametrize("shuffled", [False, True])
def test_fused_parameters_hash_as_their_concatenation_in_any_arrival_order(shuffled):
    tensors, items = moe_layer_items(shuffled)
    expected = ExpectedChecksums(arch(3), torch.float32)
    for name, tensor in items:
        expected.add(name, tensor)
    truth = {name: tensor_checksum(t) for name, t in engine_params(tensors, 3).items()}
    assert expected.result() == [truth]


def test_checksums_are_of_the_engine_dtype():
    t = torch.randn(5, 3)
    expected = ExpectedChecksums(arch(), torch.bfloat16)
    expected.add("model.norm.weight", t)
    assert expected.result() == [{"model.norm.weight": tensor_checksum(t.to(torch.bfloat16))}]


def test_the_vocabulary_is_padded_with_zero_rows_to_a_multiple_of_64():
    embed = torch.randn(70, 4)
    expected = ExpectedChecksums(arch(), torch.float32)
    expected.add("model.embed_tokens.weight", embed)
    padded = torch.cat([embed, torch.zeros(58, 4)])
    assert expected.result() == [{"model.embed_tokens.weight": tensor_checksum(padded)}]


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


# ------------------------------------------------------------------ engines of several tensor-parallel ranks
def sharded(t: dict[str, torch.Tensor], sharding, num_experts=0, heads=4, kv_heads=2) -> list[dict[str, str]]:
    expected = ExpectedChecksums(arch(num_experts, heads=heads, kv_heads=kv_heads), torch.float32, sharding)
    for name, tensor in t.items():
        expected.add(name, tensor)
    return expected.result()


def checksums_of(params: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_checksum(p.contiguous()) for name, p in params.items()}


def test_tensor_parallel_ranks_hold_row_and_column_slices_of_every_part():
    """TP2 on a GPU: q/k/v and gate/up rows are split per part and each rank's fused parameter is its slices in
    part order; o_proj and down_proj columns are split; norms are whole on every rank."""
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0"
    t = {f"{p}.self_attn.q_proj.weight": torch.randn(8, 6, generator=g),  # 4 heads of 2
         f"{p}.self_attn.k_proj.weight": torch.randn(4, 6, generator=g),  # 2 key/value heads
         f"{p}.self_attn.v_proj.weight": torch.randn(4, 6, generator=g),
         f"{p}.self_attn.o_proj.weight": torch.randn(6, 8, generator=g),
         f"{p}.mlp.gate_proj.weight": torch.randn(10, 6, generator=g),
         f"{p}.mlp.up_proj.weight": torch.randn(10, 6, generator=g),
         f"{p}.mlp.down_proj.weight": torch.randn(6, 10, generator=g),
         f"{p}.input_layernorm.weight": torch.randn(6, generator=g)}
    truth = [checksums_of({
        f"{p}.self_attn.qkv_proj.weight": torch.cat([t[f"{p}.self_attn.{x}_proj.weight"].chunk(2)[r] for x in "qkv"]),
        f"{p}.self_attn.o_proj.weight": t[f"{p}.self_attn.o_proj.weight"][:, 4 * r:4 * r + 4],
        f"{p}.mlp.gate_up_proj.weight": torch.cat([t[f"{p}.mlp.{x}_proj.weight"].chunk(2)[r] for x in ("gate", "up")]),
        f"{p}.mlp.down_proj.weight": t[f"{p}.mlp.down_proj.weight"][:, 5 * r:5 * r + 5],
        f"{p}.input_layernorm.weight": t[f"{p}.input_layernorm.weight"]}) for r in range(2)]
    assert sharded(t, EngineSharding(tp=2)) == truth


def test_more_ranks_than_key_value_heads_replicate_each_head():
    """TP4 over 2 key/value heads (GPU): ranks 0-1 hold head 0 whole, ranks 2-3 head 1; q is split 4 ways."""
    q, k, v = torch.randn(8, 3), torch.randn(4, 3), torch.randn(4, 3)
    p = "model.layers.0.self_attn"
    got = sharded({f"{p}.q_proj.weight": q, f"{p}.k_proj.weight": k, f"{p}.v_proj.weight": v}, EngineSharding(tp=4))
    assert got == [{f"{p}.qkv_proj.weight": tensor_checksum(torch.cat([q.chunk(4)[r], k.chunk(2)[r // 2],
                                                                       v.chunk(2)[r // 2]]))} for r in range(4)]


def test_expert_parallel_ranks_hold_whole_experts_of_their_block():
    """TP2 with EP2 and 4 experts: rank 0 holds experts 0-1 whole, rank 1 experts 2-3."""
    t = moe_layer(num_experts=4)
    experts = {n: x for n, x in t.items() if ".experts." in n}
    got = sharded(experts, EngineSharding(tp=2, ep=2), num_experts=4)
    p = "model.layers.0.mlp.experts"
    for rank in range(2):
        mine = range(2 * rank, 2 * rank + 2)
        w13 = torch.stack([torch.cat([t[f"{p}.{e}.gate_proj.weight"], t[f"{p}.{e}.up_proj.weight"]]) for e in mine])
        w2 = torch.stack([t[f"{p}.{e}.down_proj.weight"] for e in mine])
        assert got[rank] == {f"{p}.w13_weight": tensor_checksum(w13), f"{p}.w2_weight": tensor_checksum(w2)}


def test_a_cpu_engine_pads_the_intermediate_size_to_32_per_rank_with_zeros():
    """CPU TP2, intermediate 40 -> 64: rank 0 holds rows 0-31, rank 1 rows 32-39 and 24 zero rows (and down_proj
    the same columns)."""
    gate, up, down = torch.randn(40, 3), torch.randn(40, 3), torch.randn(3, 40)
    p = "model.layers.0.mlp"
    got = sharded({f"{p}.gate_proj.weight": gate, f"{p}.up_proj.weight": up, f"{p}.down_proj.weight": down},
                  EngineSharding(tp=2, cpu=True))

    def pad(x, dim):
        return torch.cat([x, x.new_zeros((24, 3) if dim == 0 else (3, 24))], dim=dim)

    for rank in range(2):
        assert got[rank] == checksums_of({
            f"{p}.gate_up_proj.weight": torch.cat([pad(gate, 0).chunk(2)[rank], pad(up, 0).chunk(2)[rank]]),
            f"{p}.down_proj.weight": pad(down, 1).chunk(2, dim=1)[rank]})


@pytest.mark.parametrize(("tp", "rows", "padded"), [(2, 70, 128), (3, 100, 192)])
def test_the_vocabulary_is_padded_then_split_over_the_ranks(tp, rows, padded):
    """Padded to 64 rows, or to 64 x tp when tp does not divide that; then split."""
    embed = torch.randn(rows, 2)
    got = sharded({"model.embed_tokens.weight": embed}, EngineSharding(tp=tp), heads=tp * 2, kv_heads=tp)
    full = torch.cat([embed, torch.zeros(padded - rows, 2)])
    assert got == [{"model.embed_tokens.weight": tensor_checksum(full.chunk(tp)[r])} for r in range(tp)]


def test_layouts_not_predicted():
    assert layout_supported(arch(heads=4, kv_heads=4, mla=object()), EngineSharding(tp=2, cpu=True)), "MLA"
    assert not layout_supported(arch(heads=6, kv_heads=6, mla=object()), EngineSharding(tp=4)), "SGLang refuses"
    assert not layout_supported(arch(heads=4, kv_heads=2), EngineSharding(tp=4, cpu=True)), \
        "SGLang pads key/value heads on the CPU"
    assert layout_supported(arch(heads=4, kv_heads=2), EngineSharding(tp=4))
    assert not layout_supported(arch(heads=6, kv_heads=2), EngineSharding(tp=4))
    with pytest.raises(ValueError, match="layout_supported"):
        ExpectedChecksums(arch(heads=4, kv_heads=2), torch.float32, EngineSharding(tp=4, cpu=True))


def test_sharding_of_an_engines_server_info():
    assert EngineSharding.of_server({"tp_size": 2, "ep_size": 1, "device": "cpu"}) == EngineSharding(tp=2, cpu=True)
    assert EngineSharding.of_server({"tp_size": 8, "ep_size": 8, "device": "cuda"}) == EngineSharding(tp=8, ep=8)
    with_dp_attention = EngineSharding.of_server({"tp_size": 8, "ep_size": 8, "attn_dp_size": 8, "device": "cuda"})
    assert with_dp_attention.attn_dp == 8
    assert not layout_supported(arch(heads=8, kv_heads=8), with_dp_attention), "DP attention: not predicted"


def test_the_shared_expert_fused_on_a_gpu_is_the_last_routed_expert():
    """GLM-4.5 on a GPU engine without expert parallelism: SGLang loads shared_experts.* as experts.{num_experts}."""
    p = "model.layers.0.mlp"
    tensors = {**moe_layer(2), f"{p}.shared_experts.down_proj.weight": torch.randn(6, 8)}
    glm = arch(num_experts=2, family="glm4_moe", shared=6)
    fused = ExpectedChecksums(glm, torch.float32, EngineSharding())
    for name, tensor in tensors.items():
        fused.add(name, tensor)
    as_third_expert = {name.replace(f"{p}.shared_experts.", f"{p}.experts.2."): t for name, t in tensors.items()}
    assert fused.result()[0] == {name: tensor_checksum(t) for name, t in engine_params(as_third_expert, 3).items()}
    assert not fuses_shared_experts(glm, EngineSharding(cpu=True)), "never on the CPU"
    assert not fuses_shared_experts(glm, EngineSharding(tp=8, ep=8)), "nor with expert parallelism"
    assert not fuses_shared_experts(glm, EngineSharding(shared_experts_fusion="off"))
    assert not fuses_shared_experts(glm, EngineSharding(moe_a2a="deepep"))
    deepseek = arch(num_experts=256, family="deepseek_v3", shared=6, mla=object())
    assert fuses_shared_experts(deepseek, EngineSharding(tp=8))
    assert not fuses_shared_experts(deepseek, EngineSharding(tp=8, batch_overlap=True))
    assert not fuses_shared_experts(arch(num_experts=8, family="deepseek_v3", shared=6), EngineSharding(tp=8)), \
        "only DeepSeek-V3's own shape"
    assert fuses_shared_experts(arch(num_experts=8, family="deepseek_v3", shared=6),
                                EngineSharding(cpu=True, shared_experts_fusion="forced"))
    assert not layout_supported(deepseek, EngineSharding(tp=8, shared_experts_fusion="forced", moe_a2a="deepep")), \
        "a fused shared expert in per-rank slots: not predicted"


def test_the_shared_experts_fusion_settings_of_an_engines_server_info():
    info = {"tp_size": 8, "device": "cuda", "moe_a2a_backend": "deepep", "enable_two_batch_overlap": True,
            "disable_shared_experts_fusion": True}
    assert EngineSharding.of_server(info) == EngineSharding(tp=8, shared_experts_fusion="off", moe_a2a="deepep",
                                                            batch_overlap=True)
    forced = EngineSharding.of_server({"tp_size": 8, "enforce_shared_experts_fusion": True})
    assert forced.shared_experts_fusion == "forced"


# ------------------------------------------------------------------ the hash of CUDA engines (tile_hash)
def test_the_hash_kind_is_the_engines_device():
    assert hash_kind(EngineSharding.of_server({"tp_size": 2, "device": "cuda"})) == TILE
    assert hash_kind(EngineSharding.of_server({"tp_size": 2, "device": "cpu"})) == SHA256
    assert hash_kind(EngineSharding.of_server({"tp_size": 2})) is None  # then by the tensors' device, as before


@pytest.mark.parametrize("shuffled", [False, True])
def test_the_tile_hash_of_fused_parameters_from_parts_hashed_at_their_offsets(shuffled):
    """Parts of unequal sizes (q, k, v), in any arrival order, each hashed where it lies: no fused tensor."""
    tensors, items = moe_layer_items(shuffled)
    expected = ExpectedChecksums(arch(3), torch.bfloat16, kind=TILE)
    for name, tensor in items:
        expected.add(name, tensor)
    truth = {name: tile_hash(t.to(torch.bfloat16)) for name, t in engine_params(tensors, 3).items()}
    assert expected.result() == [truth]
    sha = ExpectedChecksums(arch(3), torch.bfloat16, kind=SHA256)
    for name, tensor in items:
        sha.add(name, tensor)
    assert sha.result() == [{name: tensor_checksum(t.to(torch.bfloat16))
                             for name, t in engine_params(tensors, 3).items()}]


def expert_slots(t: dict[str, torch.Tensor], experts) -> dict[str, torch.Tensor]:
    """The expert slots (`slot_name`) of engine rank 0 of a TP1 engine for experts `experts`."""
    p = "model.layers.0.mlp.experts"
    out = {}
    for e in experts:
        out[slot_name(f"{p}.w13_weight", e)] = torch.cat([t[f"{p}.{e}.gate_proj.weight"], t[f"{p}.{e}.up_proj.weight"]])
        out[slot_name(f"{p}.w2_weight", e)] = t[f"{p}.{e}.down_proj.weight"]
    return out


def test_slots_of_one_parameter_from_two_senders_combine_under_the_tile_hash():
    """Two senders (an engine rank holding a slice of every expert, the experts owned by two trainer ranks): each
    reports its slots' partial, pickled as the owners' "done" message carries it; rank 0's `merged` combines them
    with its own complete checksums into the engine's; a slot no sender sent is an error naming the parameter."""
    import pickle

    t = moe_layer(num_experts=4)
    p = "model.layers.0.mlp.experts"
    senders = []
    for experts in ((3, 1), (0, 2)):
        sender = ExpectedChecksums(arch(4), torch.float32, kind=TILE)
        for name, tensor in reversed(expert_slots(t, experts).items()):
            sender.add_shard(0, name, tensor)
        senders.append(sender)
    own = ExpectedChecksums(arch(4), torch.float32, kind=TILE)
    own.add("model.layers.0.input_layernorm.weight", t["model.layers.0.input_layernorm.weight"])
    first, second = (pickle.loads(pickle.dumps(s.result())) for s in senders)
    assert isinstance(first[0][f"{p}.w13_weight"], TileHash)
    truth = engine_params(t, 4)
    assert merged(own.result(), [first, second]) == [{
        name: tile_hash(truth[name]) for name in (f"{p}.w13_weight", f"{p}.w2_weight",
                                                  "model.layers.0.input_layernorm.weight")}]
    lone = ExpectedChecksums(arch(4), torch.float32, kind=TILE)
    for name, tensor in expert_slots(t, (0, 1, 2)).items():
        lone.add_shard(0, name, tensor)
    with pytest.raises(RuntimeError, match=rf"{p}.w13_weight \(rank 0\)': '\d+/\d+ bytes'"):
        merged(lone.result(), [])


def test_sha256_slots_from_one_sender_only():
    """SHA-256 cannot combine parts hashed apart: an engine parameter missing slots stays an error."""
    t = moe_layer(num_experts=4)
    sender = ExpectedChecksums(arch(4), torch.float32, kind=SHA256)
    for name, tensor in expert_slots(t, (0, 1)).items():
        sender.add_shard(0, name, tensor)
    with pytest.raises(RuntimeError, match="2/4 parts"):
        sender.result()
