"""Rotary embeddings at a packed row's own positions, on Megatron-Core's local (non-THD) attention path.

GPTModel takes RoPE for positions 0..S-1 of the row whatever `position_ids` says (`position_ids` feed only learned
absolute embeddings), and the local DotProductAttention refuses `PackedSeqParams`. A packed row needs positions that
restart at every sample, so `rope_at` makes the model's rotary module return its table indexed by those positions for
the duration of one forward call. GPTModel computes the table once per forward and hands it to every layer, so
activation recomputation in the backward pass reuses the indexed table.
"""

from __future__ import annotations

import contextlib

import torch


def unwrap_gpt_model(model):
    while hasattr(model, "module"):  # Megatron DDP / Float16Module wrappers
        model = model.module
    return model


@contextlib.contextmanager
def rope_at(model, positions: torch.Tensor | None):
    """Within the block, `model`'s RoPE is at `positions` ([S] ints, each < S) instead of 0..S-1; None: unchanged.
    A model without a model-level rotary module (no RoPE, or multi-latent attention, whose layers take their own)
    is refused: its packed rows would not restart positions."""
    if positions is None:
        yield
        return
    gpt = unwrap_gpt_model(model)
    rotary = getattr(gpt, "rotary_pos_emb", None)
    if rotary is None or gpt.config.multi_latent_attention:
        raise ValueError("packed micro-batches need a model whose RoPE GPTModel applies (not multi-latent attention "
                         "or learned positions); set trainer.max_tokens_per_micro_batch=0")
    original = rotary.forward

    def indexed(*args, **kwargs):
        out = original(*args, **kwargs)  # [S, 1, 1, dim] for positions 0..S-1 (YaRN: and its mscale)
        if isinstance(out, tuple):
            return (out[0][positions.to(out[0].device)], *out[1:])
        return out[positions.to(out.device)]

    rotary.forward = indexed
    try:
        yield
    finally:
        del rotary.forward  # back to the class's (cached) forward
