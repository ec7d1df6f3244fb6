"""HF <-> Megatron for DeepSeek-V3's multi-latent attention (every layer dense: first_k_dense_replace covers them
all). Three tiny models cover q_lora_rank set / None, rope_interleave True / False, default RoPE and yarn (in
transformers 5's rope_parameters and in the legacy rope_scaling form DeepSeek-V3 ships): logits parity at TP1 and
at TP2 / PP2 (two gloo processes), bit-exact export, `convert` round trip, the converted distributed checkpoint
loads at TP2 / PP2, and what Megatron-Core saves converts back bit-exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slimish.megatron_bridge.bridge import MappingError, load_hf_weights
from slimish.megatron_bridge.hf_config import UnsupportedConfig, architecture_from_hf, read_hf_config
from tests.megatron_bridge.layouts import assert_export_is_checkpoint, assert_logits_match_hf, run_layout
from tests.megatron_bridge.parity import (
    assert_export_round_trip,
    assert_same_checkpoint,
    max_logits_diff_vs_hf,
    max_packed_vs_alone_diff,
    megatron_from_hf,
)

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
             first_k_dense_replace=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
            beta_slow=1.0)
MODELS = {
    "lora_interleaved": dict(q_lora_rank=32, rope_interleave=True, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 10000.0}),
    # Both yarn factors differ from 1: cos/sin m(4, 1) / m(4, 0.8), softmax m(4, 0.8)**2.
    "full_q_half_split_yarn": dict(q_lora_rank=None, rope_interleave=False,
                                   rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8}),
    # DeepSeek-V3's own config.json form (rope_scaling + rope_theta, "type"), written over the saved config.
    "lora_legacy_yarn": dict(q_lora_rank=32, rope_interleave=True),
}
LEGACY_ROPE = {"rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 40.0, "mscale": 1.0,
                                                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 8,
                                                        "beta_fast": 32, "beta_slow": 1}}


def build_deepseek(out: Path, *, seed: int = 0, **fields) -> Path:
    """A random fp32 DeepSeek-V3 with larger-than-default weights and random norm scales, so attention is far from
    uniform and a rotary or norm mix-up shows in the logits."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(**SHAPE, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert all(type(layer.mlp).__name__ == "DeepseekV3MLP" for layer in model.model.layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif "embed" not in name and "lm_head" not in name:
                param.normal_(0, 0.15)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    paths = {name: build_deepseek(root / name, **fields) for name, fields in MODELS.items()}
    cfg_file = paths["lora_legacy_yarn"] / "config.json"
    cfg = json.loads(cfg_file.read_text())
    del cfg["rope_parameters"]
    cfg_file.write_text(json.dumps({**cfg, **LEGACY_ROPE}, indent=2))
    return paths


def test_architecture_comes_from_config(models):
    plain = architecture_from_hf(read_hf_config(models["lora_interleaved"])).mla
    assert (plain.q_lora_rank, plain.kv_lora_rank, plain.rope_type, plain.rope_interleave) == (32, 24, "rope", True)
    yarn = architecture_from_hf(read_hf_config(models["full_q_half_split_yarn"])).mla
    assert (yarn.q_lora_rank, yarn.rope_interleave, yarn.rope_type, yarn.scaling_factor) == (None, False, "yarn", 4)
    assert (yarn.mscale, yarn.mscale_all_dim, yarn.original_max_position_embeddings) == (1.0, 0.8, 16)
    legacy = architecture_from_hf(read_hf_config(models["lora_legacy_yarn"])).mla
    assert (legacy.rope_type, legacy.scaling_factor, legacy.mscale_all_dim) == ("yarn", 40.0, 1.0)


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_hf(name, models, megatron_world):
    assert max_logits_diff_vs_hf(models[name]) <= 1e-5


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_samples_get_the_logits_they_get_alone(name, models, megatron_world):
    """Multi-latent attention (each RoPE layout and YaRN) in the trainer's packed micro-batches."""
    assert max_packed_vs_alone_diff(models[name]) <= 1e-5


def test_wrong_rope_layout_is_caught(models, megatron_world, tmp_path):
    """Negative control: the same weights read with the other rope_interleave differ clearly from HF."""
    src = models["lora_interleaved"]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    # Megatron reads the weights as rope_interleave=False (rotary rows permuted); HF keeps True.
    cfg = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_interleave": False}))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model, _ = megatron_from_hf(tmp_path)
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(tokens, torch.arange(24).expand(2, 24), None) - hf(tokens).logits).abs().max()
    assert diff > 1e-2


@pytest.mark.parametrize("name", list(MODELS))
def test_export_round_trip_is_bit_exact(name, models, megatron_world):
    assert_export_round_trip(models[name])


def test_mtp_layers_are_skipped_but_other_strays_are_not(models, megatron_world, tmp_path):
    from safetensors.torch import load_file, save_file

    from slimish.trainer.model import build_gpt_model

    src = models["lora_interleaved"]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)  # num_nextn_predict_layers=1: layer 2 is MTP
    save_file(tensors, tmp_path / "model.safetensors")
    arch = architecture_from_hf(read_hf_config(tmp_path))
    assert arch.mtp_layers == 1
    model = build_gpt_model(arch, tensor_parallel=1, pipeline_parallel=1)
    load_hf_weights(model, tmp_path, arch)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(4)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(MappingError, match="model.layers.3"):
        load_hf_weights(model, tmp_path, arch)


@pytest.mark.parametrize("field,value", [
    ("attention_bias", True), ("num_key_value_heads", 2), ("rms_norm_eps", 1e-5),
    ("quantization_config", {"quant_method": "fp8"}),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
    ("rope_parameters", {**YARN, "mscale_all_dim": 1.0}),
    ("rope_parameters", {**YARN, "attention_factor": 1.2}),
    ("rope_parameters", {**YARN, "truncate": False}),
])
def test_unsupported_config_names_the_field(models, field, value):
    cfg = {**read_hf_config(models["lora_interleaved"]), field: value}
    with pytest.raises(UnsupportedConfig) as err:
        architecture_from_hf(cfg)
    assert err.value.field.split(".")[0] == field


@pytest.fixture(scope="module")
def dist_ckpt(models, tmp_path_factory) -> Path:
    """The no-q-LoRA, half-split model (the permuted rotary rows) converted by the CLI for TP2."""
    from slimish.cli import main

    out = tmp_path_factory.mktemp("ds_dist") / "ckpt"
    assert main(["convert", "hf-to-megatron", "--hf", str(models["full_q_half_split_yarn"]), "--out", str(out),
                 "--tp", "2", "--pp", "2"]) == 0
    return out


def test_convert_round_trip_is_bit_exact(models, dist_ckpt, tmp_path):
    from slimish.megatron_bridge.convert import megatron_to_hf

    megatron_to_hf(megatron_dir=dist_ckpt, hf_config_dir=models["full_q_half_split_yarn"], out_dir=tmp_path,
                   progress=False)
    assert_same_checkpoint(tmp_path, models["full_q_half_split_yarn"])


LAYOUTS = {"tp2": dict(tp=2, pp=1), "pp2": dict(tp=1, pp=2)}
RUNS = [*MODELS, "converted"]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_run(request, models, dist_ckpt, tmp_path_factory):
    """One world per layout runs every model and the converted checkpoint, and Megatron-Core's own writer saves
    each again."""
    out = tmp_path_factory.mktemp(request.param)
    specs = {**{name: str(path) for name, path in models.items()},
             "converted": f"{models['full_q_half_split_yarn']}:{dist_ckpt}"}
    return run_layout(out / "results", models=specs, save_dist=out / "saved", **LAYOUTS[request.param]), out


def _hf_of(name: str, models: dict[str, Path]) -> Path:
    return models["full_q_half_split_yarn" if name == "converted" else name]


@pytest.mark.parametrize("name", RUNS)
def test_layout_logits_match_hf(layout_run, models, name):
    assert_logits_match_hf(layout_run[0][name], _hf_of(name, models))


@pytest.mark.parametrize("name", RUNS)
def test_layout_export_gives_back_the_checkpoint(layout_run, models, name):
    assert_export_is_checkpoint(layout_run[0][name], _hf_of(name, models))


@pytest.mark.parametrize("name", RUNS)
def test_checkpoint_saved_by_megatron_converts_to_hf(layout_run, models, name, tmp_path):
    from slimish.megatron_bridge.convert import megatron_to_hf

    megatron_to_hf(megatron_dir=layout_run[1] / "saved" / name, hf_config_dir=_hf_of(name, models),
                   out_dir=tmp_path, progress=False)
    assert_same_checkpoint(tmp_path, _hf_of(name, models))
