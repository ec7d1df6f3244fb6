"""Per-token log-probabilities from (vocab-parallel) logits, in fp32."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """log p_T(tokens[:, i+1] | tokens[:, :i+1]) for logits [B, S, V/tp] and tokens [B, S] -> [B, S-1], where
    p_T = softmax(logits / temperature).

    `temperature` is the sampling temperature of the policy that generated the tokens: SGLang samples from, and
    returns the logprobs of, softmax(logits / T) (`sglang/srt/layers/sampler.py`), so every RL logprob (old, new,
    reference, parity) must be of that same distribution. SFT uses 1.

    Uses Megatron's vocab-parallel cross entropy, which is exact at any TP size (it all-reduces the softmax
    normaliser across the vocab shards); at TP=1 it equals log_softmax + gather.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # One fresh contiguous tensor whatever the dtype and layout (the CE kernel works in place on its input); x / 1.0
    # is x exactly, so temperature 1 changes no bit.
    shifted = (logits[:, :-1, :].float() / temperature).contiguous()
    return -vocab_parallel_cross_entropy(shifted, tokens[:, 1:].contiguous())
