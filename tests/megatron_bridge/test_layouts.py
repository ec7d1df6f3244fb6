"""The bridge at TP2 and PP2 (two gloo processes): logits match HF, and export (per stage, and the whole-model
export weight sync uses) gives back the HF checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.megatron_bridge.layouts import (
    assert_export_is_checkpoint,
    assert_full_export_is_checkpoint,
    assert_logits_match_hf,
    run_layout,
)

FAMILIES = ["qwen3", "qwen2", "llama"]
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


def tied_copy(src: Path, dst: Path) -> Path:
    """`src` with tie_word_embeddings=True and no lm_head.weight (as Qwen3-0.6B ships)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    tensors = load_file(src / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory) -> dict[str, Path]:
    tied = tied_copy(tiny_models["qwen3"], tmp_path_factory.mktemp("tied") / "qwen3_tied")
    return {**{family: tiny_models[family] for family in FAMILIES}, "qwen3_tied": tied}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_run(request, models, tmp_path_factory):
    """One world per layout runs every model (process start-up dominates the cost)."""
    tp, pp = LAYOUTS[request.param]
    out = tmp_path_factory.mktemp(request.param)
    return run_layout(out, tp=tp, pp=pp, models={name: str(path) for name, path in models.items()})


@pytest.mark.parametrize("name", [*FAMILIES, "qwen3_tied"])
def test_logits_match_hf(layout_run, models, name):
    assert_logits_match_hf(layout_run[name], models[name])


@pytest.mark.parametrize("name", [*FAMILIES, "qwen3_tied"])
def test_export_gives_back_the_checkpoint(layout_run, models, name):
    assert_export_is_checkpoint(layout_run[name], models[name])


@pytest.mark.parametrize("name", [*FAMILIES, "qwen3_tied"])
def test_full_export_gives_rank0_the_checkpoint(layout_run, models, name):
    assert_full_export_is_checkpoint(layout_run[name], models[name])
