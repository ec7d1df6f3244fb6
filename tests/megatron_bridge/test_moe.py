"""HF <-> Megatron for Qwen3-MoE (4 experts, top-2; layer 1 dense via mlp_only_layers): logits parity at TP1, and
at EP2 / TP2 (two gloo processes); export and `convert` give back the HF checkpoint bit-exact; the converted
distributed checkpoint loads at EP2 / TP2; config.json drives every MoE setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slimish.megatron_bridge import dense
from slimish.megatron_bridge.bridge import export_hf_tensors
from slimish.megatron_bridge.hf_config import UnsupportedConfig, architecture_from_hf, read_hf_config
from slimish.megatron_bridge.hf_io import HFCheckpoint
from tests.megatron_bridge.layouts import (
    assert_export_is_checkpoint,
    assert_full_export_is_checkpoint,
    assert_logits_match_hf,
    run_layout,
)
from tests.megatron_bridge.parity import max_logits_diff_vs_hf, megatron_from_hf

MOE_SHAPE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])
LAYOUTS = {"ep2": dict(tp=1, pp=1, ep=2), "tp2": dict(tp=2, pp=1, ep=1)}


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
    """norm_topk_prob on (as Qwen3-30B-A3B ships) and off: the two router orders Megatron must reproduce."""
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("moe")
    normed = build_tiny_model(root / "normed", corpus=echo_digit.corpus(), family="qwen3_moe", norm_topk_prob=True,
                              **MOE_SHAPE)
    return {"normed": normed, "plain": with_config(normed, root / "plain", norm_topk_prob=False)}



def test_architecture_comes_from_config(moe_models):
    moe = architecture_from_hf(read_hf_config(moe_models["normed"])).moe
    assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.layer_pattern) == (4, 2, 32, (1, 0))
    assert not moe.pre_softmax
    assert architecture_from_hf(read_hf_config(moe_models["plain"])).moe.pre_softmax


def test_decoder_sparse_step_sets_the_layer_pattern(moe_models):
    cfg = {**read_hf_config(moe_models["normed"]), "num_hidden_layers": 4, "decoder_sparse_step": 2,
           "mlp_only_layers": [3]}
    assert architecture_from_hf(cfg).moe.layer_pattern == (0, 1, 0, 0)


@pytest.mark.parametrize("field,value", [("num_experts_per_tok", 5), ("num_local_experts", 0),
                                         ("mlp_only_layers", [0, 1]), ("decoder_sparse_step", 0),
                                         ("attention_bias", True)])
def test_unsupported_moe_config_names_the_field(moe_models, field, value):
    cfg = {**read_hf_config(moe_models["normed"]), field: value}
    with pytest.raises(UnsupportedConfig) as err:
        architecture_from_hf(cfg)
    assert err.value.field == field


@pytest.mark.parametrize("name", ["normed", "plain"])
def test_logits_match_hf(name, moe_models, megatron_world):
    assert max_logits_diff_vs_hf(moe_models[name]) <= 1e-5


def test_export_round_trip_is_bit_exact(moe_models, megatron_world):
    path = moe_models["normed"]
    model, arch = megatron_from_hf(path)
    params = {dense.canonical_megatron_name(n) for n, _ in model.named_parameters()}
    assert params == {r.megatron for r in dense.model_rules(arch)}
    ckpt = HFCheckpoint(path)
    exported = dict(export_hf_tensors(model, arch))
    assert set(exported) == set(ckpt.names()), "every HF tensor is exported exactly once"
    for name, tensor in exported.items():
        assert torch.equal(tensor, ckpt.get(name)), name


@pytest.fixture(scope="module")
def dist_ckpt(moe_models, tmp_path_factory) -> Path:
    """The normed model converted by the CLI to a Megatron distributed checkpoint, in small row blocks."""
    from slimish.megatron_bridge.convert import hf_to_megatron

    out = tmp_path_factory.mktemp("moe_dist") / "normed"
    hf_to_megatron(hf_dir=moe_models["normed"], out_dir=out, tensor_parallel=2, chunk_bytes=3000, progress=False)
    return out


def assert_same_checkpoint(got: Path, expected: Path) -> None:
    a, b = HFCheckpoint(got), HFCheckpoint(expected)
    assert sorted(a.names()) == sorted(b.names())
    for name in b.names():
        assert torch.equal(a.get(name), b.get(name)), name


def test_convert_round_trip_is_bit_exact(moe_models, dist_ckpt, tmp_path):
    from slimish.cli import main

    assert main(["convert", "megatron-to-hf", "--megatron", str(dist_ckpt), "--hf-config",
                 str(moe_models["normed"]), "--out", str(tmp_path)]) == 0
    assert_same_checkpoint(tmp_path, moe_models["normed"])


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_run(request, moe_models, dist_ckpt, tmp_path_factory):
    """One world per layout: the HF model and the converted checkpoint, which Megatron-Core saves again (the router
    orders are checked at TP1; parallelism only changes where tokens and experts go)."""
    out = tmp_path_factory.mktemp(request.param)
    models = {"normed": str(moe_models["normed"]), "converted": f"{moe_models['normed']}:{dist_ckpt}"}
    return run_layout(out / "results", models=models, save_dist=out / "saved", **LAYOUTS[request.param]), out


@pytest.mark.parametrize("name", ["normed", "converted"])
def test_layout_logits_match_hf(layout_run, moe_models, name):
    assert_logits_match_hf(layout_run[0][name], moe_models["normed"])


@pytest.mark.parametrize("name", ["normed", "converted"])
def test_layout_export_gives_back_the_checkpoint(layout_run, moe_models, name):
    assert_export_is_checkpoint(layout_run[0][name], moe_models["normed"])


@pytest.mark.parametrize("name", ["normed", "converted"])
def test_layout_full_export_gives_rank0_the_checkpoint(layout_run, moe_models, name):
    assert_full_export_is_checkpoint(layout_run[0][name], moe_models["normed"])


def test_checkpoint_saved_by_megatron_converts_to_hf(layout_run, moe_models, tmp_path):
    from slimish.megatron_bridge.convert import megatron_to_hf

    megatron_to_hf(megatron_dir=layout_run[1] / "saved" / "converted", hf_config_dir=moe_models["normed"],
                   out_dir=tmp_path, progress=False)
    assert_same_checkpoint(tmp_path, moe_models["normed"])
