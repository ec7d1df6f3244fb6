"""Packed (THD) sequences, and rows without a mask, on Megatron-Core's local attention (trainer.attention=local).

Given `PackedSeqParams(qkv_format="thd")`, Megatron-Core runs a packed row as [tokens, heads, dim] and applies RoPE
per sample (positions restart at every `cu_seqlens` boundary). The one piece that refuses it is the local
`DotProductAttention` (Transformer Engine's, the GPU one, takes it). `local_packed_block_spec` gives every layer a
core attention that does: each sample attends causally to itself only (the block-diagonal causal mask, one block at
a time), by the local attention's own computation on that sample's slice. So the GPU and CPU paths differ only in
the attention kernel behind the same `PackedSeqParams`, a packed row costs sum(len_i^2) attention rather than
(sum len_i)^2, and each sample's numbers are those it gets alone. A padded row given no mask (collation builds none:
`slimish.trainer.attention`) gets the causal one, built here on the query's device (Megatron would build it on CUDA).
"""

from __future__ import annotations

import copy
import functools

import torch


@functools.cache
def packed(core_attention: type) -> type:
    """`core_attention` (a local DotProductAttention class) that also takes THD packed sequences."""

    class PackedCoreAttention(core_attention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is None:
                if attention_mask is None:
                    attention_mask = _causal(query.shape[0], query.device)[None, None]
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            outputs = []
            for start, end in zip(bounds[:-1], bounds[1:]):  # [t, heads, dim] -> one [s, b=1, heads, dim] per sample
                outputs.append(super().forward(query[start:end, None], key[start:end, None], value[start:end, None],
                                               _causal(end - start, query.device)[None, None], attn_mask_type,
                                               attention_bias))
            return torch.cat(outputs, dim=0)  # [t, 1, heads * dim]

    PackedCoreAttention.__name__ = PackedCoreAttention.__qualname__ = f"Packed{core_attention.__name__}"
    return PackedCoreAttention


def _causal(length: int, device) -> torch.Tensor:
    """[length, length] bool, True above the diagonal (masked)."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), 1)


def local_packed_block_spec(block_spec):
    """A copy of a local-spec decoder block spec whose layers' core attention also takes packed sequences."""
    block_spec = copy.deepcopy(block_spec)
    # Layers of one kind share one spec object (the copy keeps that): wrap each object once.
    for attention in {id(a): a for a in (layer.submodules.self_attention.submodules
                                         for layer in block_spec.layer_specs)}.values():
        attention.core_attention = packed(attention.core_attention)
    return block_spec
