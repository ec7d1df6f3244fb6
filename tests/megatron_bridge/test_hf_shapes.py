"""The shapes `hf_shapes.known_hf_shapes` works out from config.json alone equal transformers' own
(`transformers_hf_shapes`, its model on the meta device) on every tiny model the tests build, the bench's, and the
target models' released configs; and a conversion of a known family does not import transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from slimish.megatron_bridge.hf_shapes import KNOWN_FAMILIES, known_hf_shapes, transformers_hf_shapes
from slimish.tasks.tiny_model import SIZES, tiny_config
from tests.conftest import REPO
from tests.megatron_bridge import test_deepseek_v3, test_moe
from tests.megatron_bridge.real_configs import REAL_CONFIGS, trimmed
from tests.megatron_bridge.test_dense_parity import LLAMA3_ROPE


def _tiny(family: str, *, drop: tuple[str, ...] = (), **fields) -> dict:
    cfg = tiny_config(family, vocab_size=320, **fields).to_dict()
    return {key: value for key, value in cfg.items() if key not in drop}


def _deepseek(**fields) -> dict:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**test_deepseek_v3.SHAPE, **fields).to_dict()


def _configs() -> dict[str, dict]:
    """name -> config.json fields of each model the tests (and benches) build, a few more variants, and the real
    models' (trimmed to few layers as test_real_shapes does)."""
    configs = {family: _tiny(family) for family in sorted(KNOWN_FAMILIES)}
    configs.update({f"moe_{name}": _tiny(family, **fields) for name, (family, fields) in test_moe.MODELS.items()})
    configs.update({f"deepseek_{name}": _deepseek(**fields) for name, fields in test_deepseek_v3.MODELS.items()})
    configs.update({
        "deepseek_v3_full_q": _tiny("deepseek_v3", q_lora_rank=None),
        "deepseek_v3_all_dense": _tiny("deepseek_v3", first_k_dense_replace=2),
        "qwen3_moe_sparse_step": _tiny("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2),
        "llama31_rope": _tiny("llama", rope_parameters=LLAMA3_ROPE, max_position_embeddings=16384),
        "qwen3_tied": _tiny("qwen3", tie_word_embeddings=True),
        # config.json without head_dim: each family's transformers default (Qwen3's is 128, not hidden / heads).
        **{f"{family}_no_head_dim": _tiny(family, drop=("head_dim",))
           for family in ("llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe")},
        "qwen3_100m": _tiny("qwen3", **SIZES["100m"]),
        "llama_bench_convert": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
                                "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
                                "vocab_size": 64000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                                "rope_theta": 500000.0, "num_hidden_layers": 3},
    })
    configs.update({f"real_{name}": trimmed(name) for name in REAL_CONFIGS})
    return configs


CONFIGS = _configs()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_known_shapes_are_transformers_shapes(name):
    cfg = CONFIGS[name]
    assert known_hf_shapes(cfg) == transformers_hf_shapes(cfg)


def test_conversion_of_a_known_family_does_not_import_transformers(tiny_models, tmp_path):
    """The shape check of a known family costs no transformers import (4-5 s of CPU in a fresh Python): nor does
    anything else in a conversion, either way."""
    code = ("import sys; from slimish.megatron_bridge.convert import hf_to_megatron, megatron_to_hf; "
            "hf_to_megatron(hf_dir=sys.argv[1], out_dir=sys.argv[2], progress=False, workers=2); "
            "megatron_to_hf(megatron_dir=sys.argv[2], hf_config_dir=sys.argv[1], out_dir=sys.argv[3], progress=False); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'megatron', 'sglang')))")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_models["qwen3"]), str(tmp_path / "megatron"),
                          str(tmp_path / "hf")], cwd=REPO, check=True, capture_output=True, text=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "megatron" / "metadata.json").exists() and (tmp_path / "hf" / "config.json").exists()
