"""In-process (one rank, TP1) Megatron model from an HF checkpoint, and its logits difference to HF."""

from __future__ import annotations

import json
import os

import torch

from slimish.megatron_bridge.bridge import load_hf_weights
from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
from slimish.trainer.batch import causal_mask


def megatron_from_hf(path):
    """(GPTModel in eval mode filled from `path`, its Architecture); needs the `megatron_world` fixture."""
    from slimish.trainer.model import build_gpt_model

    arch = architecture_from_hf(read_hf_config(path))
    model = build_gpt_model(arch, tensor_parallel=1, pipeline_parallel=1)
    load_hf_weights(model, path, arch)
    return model.eval(), arch


def max_logits_diff_vs_hf(path, *, batch: int = 3, seq: int = 40) -> float:
    """max |Megatron logits - HF logits| in fp32 on fixed random tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model, _ = megatron_from_hf(path)
    tokens = torch.randint(0, 300, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = model(tokens, torch.arange(seq).expand(batch, seq), causal_mask(batch, seq))
    assert got.shape == expected.shape
    return record((got - expected).abs().max().item())


def record(diff: float) -> float:
    """Append {test, max_abs_diff} to $SLIMISH_PARITY_LOG (a jsonl file) when set: the figures for a report."""
    if os.environ.get("SLIMISH_PARITY_LOG"):
        with open(os.environ["SLIMISH_PARITY_LOG"], "a") as log:
            log.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "?"), "max_abs_diff": diff}) + "\n")
    return diff
