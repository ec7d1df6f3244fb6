"""HF <-> Megatron for the mixture-of-experts families: Qwen3-MoE (softmax router, a dense layer via
mlp_only_layers), GLM-4.5 (sigmoid router with correction bias and expert groups, shared expert, first dense
layer, partial rotary, q/k/v bias, qk-norm) and DeepSeek-V3 (the same router choosing 2 of 4 expert groups,
multi-latent attention; test_deepseek_v3.py covers MLA's variants). Logits parity at TP1, and at TP2 / EP2 / PP2
(two gloo processes); export and `convert` give back the HF checkpoint bit-exact; the converted distributed
checkpoint loads at every layout; config.json drives every MoE setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slimish.megatron_bridge.hf_config import UnsupportedConfig, architecture_from_hf, read_hf_config
from tests.megatron_bridge.layouts import (
    assert_export_is_checkpoint,
    assert_full_export_is_checkpoint,
    assert_logits_match_hf,
    assert_owned_export_is_checkpoint,
    run_layout,
)
from tests.megatron_bridge.parity import (
    assert_export_round_trip,
    assert_same_checkpoint,
    max_logits_diff_vs_hf,
    max_packed_vs_alone_diff,
)

# name -> (family, config fields on top of tiny_model.FAMILY_SHAPES). The first model of each family is the one
# converted and run at every layout; the others only change the router arithmetic, checked at TP1.
MODELS = {
    "qwen3_moe": ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[1])),
    "glm4_moe": ("glm4_moe", dict(n_routed_experts=8, n_group=4, topk_group=1, use_qk_norm=True)),
    "deepseek_v3": ("deepseek_v3", {}),
    "glm4_moe_plain": ("glm4_moe", dict(routed_scaling_factor=1.0, n_shared_experts=2, partial_rotary_factor=1.0,
                                        attention_bias=False)),
}
FAMILIES = ["qwen3_moe", "glm4_moe", "deepseek_v3"]
# tp2-etp1-ep2: two ranks, attention split over both (TP2), each expert whole (expert tensor parallelism 1) and the
# experts split between them (EP2): a parameter outside the experts is gathered over TP, an expert sent over EP.
LAYOUTS = {"ep2": dict(tp=1, pp=1, ep=2), "tp2": dict(tp=2, pp=1, ep=1), "pp2": dict(tp=1, pp=2, ep=1),
           "tp2-etp1-ep2": dict(tp=2, pp=1, ep=2, etp=1)}
SIZES = {"ep2": dict(tp=1, etp=1, ep=2, dp=2, edp=1), "tp2": dict(tp=2, etp=2, ep=1, dp=1, edp=1),
         "pp2": dict(tp=1, etp=1, ep=1, dp=1, edp=1), "tp2-etp1-ep2": dict(tp=2, etp=1, ep=2, dp=1, edp=1)}


def with_config(src: Path, dst: Path, **fields) -> Path:
    """A copy of the model in `src` with config.json fields replaced (the weights do not depend on them)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **fields}))
    return dst


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, Path]:
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("moe")
    models = {name: build_tiny_model(root / name, corpus=echo_digit.corpus(), family=family, **fields)
              for name, (family, fields) in MODELS.items()}
    # norm_topk_prob off: the other softmax order Megatron must reproduce (pre-softmax).
    models["qwen3_moe_plain"] = with_config(models["qwen3_moe"], root / "qwen3_moe_plain", norm_topk_prob=False)
    return models


def test_qwen3_moe_architecture_comes_from_config(moe_models):
    moe = architecture_from_hf(read_hf_config(moe_models["qwen3_moe"])).moe
    assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.layer_pattern) == (4, 2, 32, (1, 0))
    assert not moe.pre_softmax and moe.score_function == "softmax" and moe.shared_ffn_hidden_size is None
    assert architecture_from_hf(read_hf_config(moe_models["qwen3_moe_plain"])).moe.pre_softmax


def test_glm4_moe_architecture_comes_from_config(moe_models):
    arch = architecture_from_hf(read_hf_config(moe_models["glm4_moe"]))
    moe = arch.moe
    assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.layer_pattern) == (8, 2, 32, (0, 1))
    assert (moe.score_function, moe.expert_bias, moe.num_groups, moe.group_topk) == ("sigmoid", True, 4, 1)
    assert (moe.scaling_factor, moe.shared_ffn_hidden_size) == (2.5, 32)
    assert (arch.rotary_percent, arch.add_qkv_bias, arch.qk_layernorm) == (0.5, True, True)
    deepseek = architecture_from_hf(read_hf_config(moe_models["deepseek_v3"]))
    assert (deepseek.moe.topk, deepseek.moe.num_groups, deepseek.moe.group_topk) == (4, 4, 2)
    assert deepseek.moe.layer_pattern == (0, 1) and deepseek.mla.kv_lora_rank == 24
    plain = architecture_from_hf(read_hf_config(moe_models["glm4_moe_plain"]))
    assert (plain.moe.num_groups, plain.moe.scaling_factor, plain.moe.shared_ffn_hidden_size) == (None, None, 64)
    assert (plain.rotary_percent, plain.add_qkv_bias, plain.qk_layernorm) == (1.0, False, False)


def test_decoder_sparse_step_sets_the_layer_pattern(moe_models):
    cfg = {**read_hf_config(moe_models["qwen3_moe"]), "num_hidden_layers": 4, "decoder_sparse_step": 2,
           "mlp_only_layers": [3]}
    assert architecture_from_hf(cfg).moe.layer_pattern == (0, 1, 0, 0)


@pytest.mark.parametrize("name,field,value", [
    ("qwen3_moe", "num_experts_per_tok", 5), ("qwen3_moe", "num_local_experts", 0),
    ("qwen3_moe", "mlp_only_layers", [0, 1]), ("qwen3_moe", "decoder_sparse_step", 0),
    ("qwen3_moe", "attention_bias", True),
    # HF ranks expert groups by their best two scores; Megatron by their best top-k // topk_group.
    ("glm4_moe", "topk_group", 2), ("glm4_moe", "n_group", 3), ("glm4_moe", "norm_topk_prob", False),
    ("glm4_moe", "num_experts_per_tok", 1),
    ("glm4_moe", "topk_method", "greedy"),
    ("glm4_moe", "quantization_config", {"quant_method": "fp8"}), ("glm4_moe", "partial_rotary_factor", 0.0),
    ("deepseek_v3", "topk_group", 1), ("deepseek_v3", "scoring_func", "softmax"),
    ("deepseek_v3", "moe_layer_freq", 2),
])
def test_unsupported_moe_config_names_the_field(moe_models, name, field, value):
    cfg = {**read_hf_config(moe_models[name]), field: value}
    if field == "partial_rotary_factor":
        cfg["rope_parameters"] = {**cfg["rope_parameters"], field: value}
    with pytest.raises(UnsupportedConfig) as err:
        architecture_from_hf(cfg)
    assert err.value.field == field


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_plain", "glm4_moe", "glm4_moe_plain", "deepseek_v3"])
def test_logits_match_hf(name, moe_models, megatron_world):
    assert max_logits_diff_vs_hf(moe_models[name]) <= 1e-5


@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_packed_samples_get_the_logits_they_get_alone(name, moe_models, megatron_world):
    """Routed experts (and GLM's partial rotary) in the trainer's packed micro-batches."""
    assert max_packed_vs_alone_diff(moe_models[name]) <= 1e-5


@pytest.mark.parametrize("name", FAMILIES)
def test_export_round_trip_is_bit_exact(name, moe_models, megatron_world):
    assert_export_round_trip(moe_models[name])


@pytest.fixture(scope="module")
def dist_ckpts(moe_models, tmp_path_factory) -> dict[str, Path]:
    """Each family's model converted by the CLI's function to a Megatron distributed checkpoint, in small row
    blocks."""
    from slimish.megatron_bridge.convert import hf_to_megatron

    root = tmp_path_factory.mktemp("moe_dist")
    return {name: hf_to_megatron(hf_dir=moe_models[name], out_dir=root / name, tensor_parallel=2, expert_parallel=2,
                                 chunk_bytes=3000, progress=False) for name in FAMILIES}


@pytest.mark.parametrize("name", FAMILIES)
def test_convert_round_trip_is_bit_exact(name, moe_models, dist_ckpts, tmp_path):
    from slimish.cli import main

    assert main(["convert", "megatron-to-hf", "--megatron", str(dist_ckpts[name]), "--hf-config",
                 str(moe_models[name]), "--out", str(tmp_path)]) == 0
    assert_same_checkpoint(tmp_path, moe_models[name])


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_run(request, moe_models, dist_ckpts, tmp_path_factory):
    """One world per layout running each family's HF model and its converted checkpoint, which Megatron-Core saves
    again (the router orders are checked at TP1; parallelism only changes where tokens and experts go)."""
    out = tmp_path_factory.mktemp(request.param)
    models = {}
    for name in FAMILIES:
        models[name] = str(moe_models[name])
        models[f"{name}_converted"] = f"{moe_models[name]}:{dist_ckpts[name]}"
    results = run_layout(out / "results", models=models, save_dist=out / "saved", **LAYOUTS[request.param])
    assert all(r["sizes"] == SIZES[request.param] for rs in results.values() for r in rs), "Megatron's groups"
    return results, out


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("source", ["hf", "converted"])
def test_layout_logits_match_hf(layout_run, moe_models, name, source):
    assert_logits_match_hf(layout_run[0][name if source == "hf" else f"{name}_converted"], moe_models[name])


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("source", ["hf", "converted"])
def test_layout_export_gives_back_the_checkpoint(layout_run, moe_models, name, source):
    assert_export_is_checkpoint(layout_run[0][name if source == "hf" else f"{name}_converted"], moe_models[name])


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("source", ["hf", "converted"])
def test_layout_full_export_gives_rank0_the_checkpoint(layout_run, moe_models, name, source):
    assert_full_export_is_checkpoint(layout_run[0][name if source == "hf" else f"{name}_converted"], moe_models[name])


@pytest.mark.parametrize("name", FAMILIES)
def test_layout_owned_export_spreads_the_checkpoint_over_its_owners(layout_run, moe_models, name):
    """The owners' export (the weight sync's several senders) yields every tensor once, each stage's on its own."""
    assert_owned_export_is_checkpoint(layout_run[0][name], moe_models[name])


@pytest.mark.parametrize("name", FAMILIES)
def test_checkpoint_saved_by_megatron_converts_to_hf(layout_run, moe_models, name, tmp_path):
    from slimish.megatron_bridge.convert import megatron_to_hf

    megatron_to_hf(megatron_dir=layout_run[1] / "saved" / f"{name}_converted", hf_config_dir=moe_models[name],
                   out_dir=tmp_path, progress=False)
    assert_same_checkpoint(tmp_path, moe_models[name])
