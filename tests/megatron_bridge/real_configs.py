"""The target models' released config.json fields (kept in the package: `slimish.megatron_bridge.known_models`, which
`slimish plan` reads by name). `LAYERS_FOR_TEST` trims a mixture-of-experts model to its dense layers plus one sparse
layer: every sparse layer has the same shapes, and building all of them on the meta device only costs time."""

from __future__ import annotations

from slimish.megatron_bridge.known_models import (
    DEEPSEEK_V3,
    GLM45,
    LLAMA31_405B,
    QWEN3_8B,
    QWEN3_30B_A3B,
    QWEN3_235B_A22B,
)

REAL_CONFIGS = {"llama31_405b": LLAMA31_405B, "qwen3_8b": QWEN3_8B, "qwen3_30b_a3b": QWEN3_30B_A3B,
                "qwen3_235b_a22b": QWEN3_235B_A22B, "deepseek_v3": DEEPSEEK_V3, "glm45": GLM45}

LAYERS_FOR_TEST = {"qwen3_30b_a3b": 2, "qwen3_235b_a22b": 2, "deepseek_v3": 4, "glm45": 4}


def trimmed(name: str) -> dict:
    """The config of `name` with LAYERS_FOR_TEST layers (if listed) and no multi-token-prediction layer."""
    cfg = dict(REAL_CONFIGS[name])
    if name in LAYERS_FOR_TEST:
        cfg["num_hidden_layers"] = LAYERS_FOR_TEST[name]
    cfg.pop("num_nextn_predict_layers", None)
    return cfg
