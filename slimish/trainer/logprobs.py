"""Per-token log-probabilities from (vocab-parallel) logits, in fp32."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[:, i+1] | tokens[:, :i+1]) for logits [B, S, V/tp] and tokens [B, S] -> [B, S-1].

    Uses Megatron's vocab-parallel cross entropy, which is exact at any TP size (it all-reduces the softmax
    normaliser across the vocab shards); at TP=1 it equals log_softmax + gather.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    shifted = logits[:, :-1, :].float().contiguous()  # the CE kernel works in place on its input
    return -vocab_parallel_cross_entropy(shifted, tokens[:, 1:].contiguous())
