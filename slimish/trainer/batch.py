"""Turn samples into Megatron micro-batches: right-padded rows (`collate`) or one packed row (`collate_packed`).

Convention: per-token tensors of a micro-batch are [B, S-1] and index i holds the log-probability of
tokens[:, i + 1] (the token predicted by position i). A response token at absolute position p of its row therefore
lives at index p - 1. `rows` and `spans` map every sample back to its response: row `rows[j]`, [start, end) of the
[S-1] axis.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from slimish.sample import Sample

HOST = torch.device("cpu")  # micro-batches are built in host memory; `MicroBatch.to` moves them


@dataclass
class MicroBatch:
    tokens: torch.Tensor          # [B, S] int64, right-padded
    position_ids: torch.Tensor    # [B, S]; packed: restarting at 0 for every sample
    loss_mask: torch.Tensor       # [B, S-1] float: `Sample.train_mask` (0 for a sample that does not train)
    spans: list[tuple[int, int]]  # per sample: [start, end) of its response in the [S-1] axis of its row
    rows: list[int]               # per sample: its row
    cu_seqlens: list[int] | None = None  # packed: sample boundaries in the row (0, len0, len0 + len1, ...)
    # Context parallelism: this rank's share of the rows (`slimish.trainer.context_parallel`), set by the schedule
    # on the device's copy; None without it.
    shard: object = None
    # Per-token [B, S-1] inputs of the losses, filled in as the step goes (None until then):
    rollout_logprobs: torch.Tensor | None = None  # the engines' (float32)
    old_logprobs: torch.Tensor | None = None      # the trainer's before the step (rl_step.prepare)
    ref_logprobs: torch.Tensor | None = None      # the reference model's
    old_values: torch.Tensor | None = None        # the critic's before the step
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None           # the critic's targets
    weights: torch.Tensor | None = None           # the loss's per-token weights (loss_mask, or 1/length per sample)
    segments: torch.Tensor | None = None          # long: the sample index over its response span, -1 elsewhere

    def to(self, device: torch.device, *, non_blocking: bool = False) -> MicroBatch:
        """This micro-batch with every tensor on `device` (itself when they are all there already). From pinned
        host memory to a GPU the copies are asynchronous with `non_blocking`."""
        if all(value.device == device for _, value in self._tensors()):
            return self
        return self.apply(lambda value: value.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> MicroBatch:
        """This micro-batch with its tensors in page-locked host memory (for asynchronous copies to a GPU)."""
        return self.apply(torch.Tensor.pin_memory)

    def apply(self, fn) -> MicroBatch:
        """This micro-batch with `fn(tensor)` in place of each tensor. No mask is among them: every attention is
        causal within a row or a packed sample (`slimish.trainer.attention`), so no [S, S] tensor is built."""
        return dataclasses.replace(self, **{name: fn(value) for name, value in self._tensors()})

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(field name, tensor) of every field that holds a tensor now."""
        return [(f.name, value) for f in dataclasses.fields(self)
                if isinstance(value := getattr(self, f.name), torch.Tensor)]

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def sequence_bounds(self) -> list[int]:
        """Where the sequences of a row start and end: `cu_seqlens` packed, [0, S] padded."""
        return self.cu_seqlens if self.packed else [0, self.tokens.shape[1]]

    def packed_seq_params(self, bounds_device: torch.device = HOST):
        """Megatron's THD description of a packed row (each sample attends causally to itself, RoPE positions
        restart per sample); None for padded rows. Its `cu_seqlens` are on `bounds_device`: Transformer Engine's
        attention needs them on its GPU; the local and SDPA attentions and Megatron's unfused RoPE read them on the
        host each layer (`.tolist()`), which costs no device sync when they are there already."""
        if not self.packed:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        bounds = torch.tensor(self.cu_seqlens, dtype=torch.int32, device=bounds_device)
        longest = max(b - a for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]))
        # The bounds are of the whole row under context parallelism too, and every sequence already a multiple of
        # 2 x cp: Transformer Engine's "padded" bounds are the same ones.
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=longest,
                               max_seqlen_kv=longest, cu_seqlens_q_padded=bounds, cu_seqlens_kv_padded=bounds)

    def scatter(self, values: list[torch.Tensor]) -> torch.Tensor:
        """[B, S-1]: each sample's [response length] values over its response span, 0 elsewhere."""
        out = torch.zeros_like(self.loss_mask)
        for row, (start, end), value in zip(self.rows, self.spans, values):
            out[row, start:end] = value
        return out

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Each sample's response span of a [B, S-1] tensor."""
        return [tensor[row, start:end] for row, (start, end) in zip(self.rows, self.spans)]

    def sample_segments(self) -> torch.Tensor:
        """[B, S-1] long: the micro-batch's sample index j over sample j's response span, -1 elsewhere."""
        out = torch.full(self.loss_mask.shape, -1, dtype=torch.long, device=self.loss_mask.device)
        for j, (row, (start, end)) in enumerate(zip(self.rows, self.spans)):
            out[row, start:end] = j
        return out

    def trained_samples(self) -> int:
        return sum(int(self.loss_mask[row, start:end].sum() > 0) for row, (start, end) in zip(self.rows, self.spans))

    def sequence_weights(self) -> torch.Tensor:
        """loss_mask with each sample's tokens weighted 1 / its trained-token count: summed, one per sample that
        trains (how `seq_mean` averages per sequence, packed or not)."""
        out = torch.zeros_like(self.loss_mask)
        for row, (start, end) in zip(self.rows, self.spans):
            mask = self.loss_mask[row, start:end]
            out[row, start:end] = mask / mask.sum().clamp(min=1)
        return out


def collate(samples: list[Sample], *, pad_id: int, seq_len: int | None = None, rows: int | None = None,
            multiple_of: int = 1, per_token: dict[str, list[list[float]]] | None = None) -> MicroBatch:
    """Pack `samples` into one micro-batch in host memory, padded to `seq_len` (default: the longest sample, rounded
    up to a multiple of `multiple_of`: sequence parallelism splits the sequence evenly over the tensor-parallel
    ranks) and to `rows` rows (default: one per sample; the rest padding that trains nothing: the interleaved
    pipeline needs every micro-batch of a schedule in one shape). `per_token`: MicroBatch field -> each sample's
    values over its response (e.g. "rollout_logprobs")."""
    longest = max((len(s.tokens) for s in samples), default=1)
    seq_len = seq_len or _round_up(longest, multiple_of)
    if seq_len < longest:
        raise ValueError(f"seq_len {seq_len} shorter than the longest sample ({longest} tokens)")
    batch = max(rows or len(samples), len(samples), 1)
    tokens = torch.full((batch, seq_len), pad_id, dtype=torch.long, device=HOST)
    loss_mask = torch.zeros(batch, seq_len - 1, device=HOST)
    fields = {key: torch.zeros(batch, seq_len - 1, device=HOST) for key in (per_token or {})}
    spans = []
    for row, sample in enumerate(samples):
        ids = sample.tokens
        tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long, device=HOST)
        start = len(sample.prompt_ids) - 1
        end = start + len(sample.response_ids)
        spans.append((start, end))
        loss_mask[row, start:end] = torch.tensor(sample.train_mask, dtype=torch.float32, device=HOST)
        for key, values in (per_token or {}).items():
            fields[key][row, start:end] = torch.tensor(values[row], dtype=torch.float32, device=HOST)
    position_ids = torch.arange(seq_len, dtype=torch.long, device=HOST).expand(batch, seq_len).contiguous()
    return MicroBatch(tokens=tokens, position_ids=position_ids, loss_mask=loss_mask, spans=spans,
                      rows=list(range(len(samples))), **fields)


def collate_packed(samples: list[Sample], *, pad_id: int, multiple_of: int = 1, sequence_multiple: int = 1,
                   length: int | None = None, per_token: dict[str, list[list[float]]] | None = None) -> MicroBatch:
    """`samples` back to back in one row of sum(len(tokens)) tokens (in host memory), described to the model by
    `cu_seqlens` (`packed_seq_params`): every token attends causally within its own sample only and positions
    restart per sample, so each sample's logprobs are those it gets alone. The predictions across a boundary (last
    token of one sample -> first of the next) are never trained on: a sample's first token is a prompt token. No
    samples: one padding token, nothing trained. Each sequence is padded to a multiple of `sequence_multiple`
    (context parallelism cuts every sequence into 2 x cp chunks): padding tokens after its sample, in its segment of
    `cu_seqlens`, trained on by nothing. A row whose length is not a multiple of `multiple_of` ends with a segment
    of padding tokens of its own (attending to itself only), as does a row shorter than `length` (the interleaved
    pipeline's one shape for every micro-batch of a schedule: `packed_lengths` gives it)."""
    lengths = packed_lengths(samples, multiple_of=multiple_of, sequence_multiple=sequence_multiple)
    if length is not None and length > sum(lengths):
        lengths.append(length - sum(lengths))
    seq_len = sum(lengths)
    tokens = torch.full((1, seq_len), pad_id, dtype=torch.long, device=HOST)
    positions = torch.cat([torch.arange(n, dtype=torch.long, device=HOST) for n in lengths])[None]
    loss_mask = torch.zeros(1, seq_len - 1, device=HOST)
    fields = {key: torch.zeros(1, seq_len - 1, device=HOST) for key in (per_token or {})}
    spans, offset = [], 0
    for j, sample in enumerate(samples):
        tokens[0, offset: offset + len(sample.tokens)] = torch.tensor(sample.tokens, dtype=torch.long, device=HOST)
        start = offset + len(sample.prompt_ids) - 1
        end = start + len(sample.response_ids)
        spans.append((start, end))
        loss_mask[0, start:end] = torch.tensor(sample.train_mask, dtype=torch.float32, device=HOST)
        for key, values in (per_token or {}).items():
            fields[key][0, start:end] = torch.tensor(values[j], dtype=torch.float32, device=HOST)
        offset += lengths[j]
    cu_seqlens = [0]
    for n in lengths:
        cu_seqlens.append(cu_seqlens[-1] + n)
    return MicroBatch(tokens=tokens, position_ids=positions, loss_mask=loss_mask, spans=spans,
                      rows=[0] * len(samples), cu_seqlens=cu_seqlens, **fields)


def packed_lengths(samples: list[Sample], *, multiple_of: int = 1, sequence_multiple: int = 1) -> list[int]:
    """The segments of `collate_packed`'s row for `samples`: each sample's tokens rounded up to `sequence_multiple`,
    then a padding segment that rounds the row up to `multiple_of`."""
    lengths = [_round_up(len(s.tokens), sequence_multiple) for s in samples] or [_round_up(1, sequence_multiple)]
    if padding := _round_up(sum(lengths), multiple_of) - sum(lengths):
        lengths.append(padding)
    return lengths


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def split(items: list, size: int) -> list[list]:
    return [items[i: i + size] for i in range(0, len(items), size)]
