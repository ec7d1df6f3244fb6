"""HF <-> Megatron for the dense families at TP1: logits parity, bit-exact round trip, strict mapping."""

from __future__ import annotations

import pytest
import torch

from slimish.megatron_bridge import dense
from slimish.megatron_bridge.bridge import MappingError, load_hf_weights
from slimish.megatron_bridge.hf_config import UnsupportedConfig, architecture_from_hf, read_hf_config
from slimish.megatron_bridge.hf_io import CheckpointError, HFCheckpoint
from tests.megatron_bridge.parity import (
    assert_export_round_trip,
    max_logits_diff_vs_hf,
    max_packed_vs_alone_diff,
    megatron_from_hf,
)

FAMILIES = ["qwen3", "qwen2", "llama"]
# Llama-3.1's RoPE frequency scaling (rope_type llama3), as Llama-3.1-405B ships it.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf(family, tiny_models, megatron_world):
    assert max_logits_diff_vs_hf(tiny_models[family]) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_samples_get_the_logits_they_get_alone(family, tiny_models, megatron_world):
    """Several samples in one row (the trainer's packed micro-batches): attention stays within each sample and
    RoPE positions restart at each, on the local layer spec the trainer uses on CPU."""
    assert max_packed_vs_alone_diff(tiny_models[family]) <= 1e-5


@pytest.fixture(scope="module")
def llama31(tmp_path_factory):
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("llama31"), corpus=echo_digit.corpus(), family="llama",
                            rope_parameters=LLAMA3_ROPE, max_position_embeddings=16384, init_std=0.1)


def test_llama31_rope_scaling_matches_hf(llama31, tiny_models, megatron_world):
    from transformers import AutoModelForCausalLM

    arch = architecture_from_hf(read_hf_config(llama31))
    assert arch.rope_llama3_factor == 8.0
    assert max_logits_diff_vs_hf(llama31) <= 1e-5
    assert max_packed_vs_alone_diff(llama31) <= 1e-5
    # The scaling moves this model's logits by ~1e-2 (its lowest frequencies are scaled): the check above sees it.
    tokens = torch.arange(40).unsqueeze(0)
    with torch.no_grad():
        scaled = AutoModelForCausalLM.from_pretrained(llama31, dtype=torch.float32)(tokens).logits
        plain = AutoModelForCausalLM.from_pretrained(llama31, dtype=torch.float32,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 1e4})
        assert (scaled - plain(tokens).logits).abs().max() > 1e-3


@pytest.mark.parametrize("field,value", [("low_freq_factor", 2.0), ("original_max_position_embeddings", 4096)])
def test_llama31_rope_fields_megatron_fixes_are_checked(llama31, field, value):
    cfg = read_hf_config(llama31)
    cfg["rope_parameters"] = {**cfg["rope_parameters"], field: value}
    with pytest.raises(UnsupportedConfig) as err:
        architecture_from_hf(cfg)
    assert err.value.field == f"rope_parameters.{field}"


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip_is_bit_exact(family, tiny_models, megatron_world):
    assert_export_round_trip(tiny_models[family])


def test_unmapped_hf_tensor_is_an_error(tiny_models, megatron_world, tmp_path):
    from safetensors.torch import load_file, save_file

    from slimish.trainer.model import build_gpt_model

    src = tiny_models["qwen3"]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.mlp.extra_bias"] = torch.zeros(4)
    save_file(tensors, tmp_path / "model.safetensors")
    arch = architecture_from_hf(read_hf_config(tmp_path))
    model = build_gpt_model(arch, tensor_parallel=1, pipeline_parallel=1)
    with pytest.raises(MappingError, match="no Megatron mapping"):
        load_hf_weights(model, tmp_path, arch)


def test_every_megatron_param_has_a_rule(tiny_models, megatron_world):
    model, arch = megatron_from_hf(tiny_models["qwen2"])
    rules = {r.megatron for r in dense.model_rules(arch)}
    params = {dense.canonical_megatron_name(n) for n, _ in model.named_parameters()}
    assert params == rules


def test_truncated_shard_names_the_file(tiny_models, tmp_path):
    data = (tiny_models["qwen3"] / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        ckpt = HFCheckpoint(tmp_path)
        for name in ckpt.names():
            ckpt.get(name)


@pytest.mark.parametrize("field,value", [("hidden_act", "gelu"), ("rope_scaling", {"type": "yarn", "factor": 4}),
                                         ("use_sliding_window", True), ("model_type", "gpt2"),
                                         ("attention_dropout", 0.1), ("attention_bias", True),
                                         ("rope_parameters", {"rope_type": "yarn", "factor": 4.0})])
def test_unsupported_config_names_the_field(tiny_models, field, value):
    cfg = read_hf_config(tiny_models["qwen3"])
    cfg[field] = value
    with pytest.raises(UnsupportedConfig) as err:
        architecture_from_hf(cfg)
    assert err.value.field.split(".")[0] == field
