"""Turn samples into right-padded Megatron micro-batches.

Convention: per-token tensors of a micro-batch are [B, S-1] and index i holds the log-probability of
tokens[:, i + 1] (the token predicted by position i). A response token at absolute position p therefore lives at
index p - 1. `response_slices` maps every sample back to its response span.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimish.sample import Sample


@dataclass
class MicroBatch:
    tokens: torch.Tensor          # [B, S] int64, right-padded
    position_ids: torch.Tensor    # [B, S]
    attention_mask: torch.Tensor  # [B, 1, S, S] bool, True = masked (causal; padding sits after every real token)
    loss_mask: torch.Tensor       # [B, S-1] float: `Sample.train_mask` (0 for a sample that does not train)
    spans: list[tuple[int, int]]  # per sample: [start, end) of its response in the [S-1] axis
    extras: dict                  # per-token [B, S-1] tensors (old_logprobs, ref_logprobs) and [B] advantages


def causal_mask(batch: int, seq_len: int, device=None) -> torch.Tensor:
    # Megatron's mask=None path builds the mask on CUDA, so it is always passed explicitly.
    mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)
    return mask.expand(batch, 1, seq_len, seq_len)


def collate(samples: list[Sample], *, pad_id: int, seq_len: int | None = None,
            per_token: dict[str, list[list[float]]] | None = None,
            per_sample: dict[str, list[float]] | None = None) -> MicroBatch:
    """Pack `samples` into one micro-batch, padded to `seq_len` (default: the longest sample)."""
    longest = max(len(s.tokens) for s in samples)
    seq_len = seq_len or longest
    if seq_len < longest:
        raise ValueError(f"seq_len {seq_len} shorter than the longest sample ({longest} tokens)")
    batch = len(samples)
    tokens = torch.full((batch, seq_len), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(batch, seq_len - 1)
    extras = {key: torch.zeros(batch, seq_len - 1) for key in (per_token or {})}
    spans = []
    for row, sample in enumerate(samples):
        ids = sample.tokens
        tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        start = len(sample.prompt_ids) - 1
        end = start + len(sample.response_ids)
        spans.append((start, end))
        loss_mask[row, start:end] = torch.tensor(sample.train_mask, dtype=torch.float32)
        for key, values in (per_token or {}).items():
            extras[key][row, start:end] = torch.tensor(values[row], dtype=torch.float32)
    for key, values in (per_sample or {}).items():
        extras[key] = torch.tensor(values, dtype=torch.float32)
    position_ids = torch.arange(seq_len, dtype=torch.long).expand(batch, seq_len).contiguous()
    return MicroBatch(tokens=tokens, position_ids=position_ids, attention_mask=causal_mask(batch, seq_len),
                      loss_mask=loss_mask, spans=spans, extras=extras)


def split(items: list, size: int) -> list[list]:
    return [items[i: i + size] for i in range(0, len(items), size)]
