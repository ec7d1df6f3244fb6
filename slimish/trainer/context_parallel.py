"""Context parallelism (parallel.context_parallel): which tokens of a micro-batch a context-parallel rank runs, and
its per-token results made whole again.

Megatron's load balancing: a sequence of n tokens (n a multiple of 2 x cp) is cut into 2 x cp chunks of n / (2 cp);
rank r holds chunks r and 2 cp - 1 - r, so every rank has the same share of the causal attention's work. A padded
row is one such sequence; a packed row is several, each cut on its own (THD: the packed sequence parameters keep the
whole row's bounds, as Transformer Engine and Megatron's RoPE expect, and Megatron picks each rank's RoPE positions).

The model sees only this rank's tokens. The heads (`slimish.trainer.logprobs.LogprobHead`, the critic's value head)
compute this rank's positions, and `ContextShard.gather` makes the [B, S] result whole on every rank of the group,
so that everything after the heads (losses, estimators, metrics) is what it is without context parallelism. Each
rank then computes the same whole loss; the gather's backward keeps the gradient of this rank's positions, and
Megatron's DDP sums the parameters' gradients over the data x context-parallel group (the step scales the loss by
the group's size: it averages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def local_positions(bounds: list[int], size: int, rank: int) -> list[int]:
    """The row positions context-parallel rank `rank` of `size` holds, in the order it holds them: for each sequence
    [a, b) of `bounds` (a padded row: [0, S]), its chunks `rank` and 2 size - 1 - rank of (b - a) / (2 size)."""
    out: list[int] = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if (end - start) % (2 * size):
            raise ValueError(f"a sequence of {end - start} tokens does not split into 2 x {size} chunks")
        chunk = (end - start) // (2 * size)
        for c in (rank, 2 * size - 1 - rank):
            out.extend(range(start + c * chunk, start + (c + 1) * chunk))
    return out


@dataclass(frozen=True)
class ContextShard:
    """This rank's share of a micro-batch's rows: `indices` [s_local] (long, on the model's device) are the positions
    it holds of rows of `length` tokens; `order` [S] puts every rank's shares, gathered rank after rank, back in row
    order."""
    size: int
    rank: int
    group: object
    length: int
    indices: torch.Tensor
    order: torch.Tensor

    @classmethod
    def of(cls, bounds: list[int], *, size: int, rank: int, group, device) -> ContextShard:
        shares = [local_positions(bounds, size, r) for r in range(size)]
        order = [0] * bounds[-1]  # row position -> where it lies in the shares gathered rank after rank
        for at, position in enumerate(p for share in shares for p in share):
            order[position] = at
        return cls(size=size, rank=rank, group=group, length=bounds[-1],
                   indices=torch.tensor(shares[rank], dtype=torch.long, device=device),
                   order=torch.tensor(order, dtype=torch.long, device=device))

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """[B, s_local] of a [B, S] tensor: this rank's positions."""
        return tensor.index_select(1, self.indices)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] in row order from every rank's [B, s_local, ...] (this rank's: `local`). Its backward keeps
        the gradient at this rank's positions: every rank computes the same loss of the whole rows."""
        return _Gather.apply(local, self)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, shard: ContextShard) -> torch.Tensor:
        from slimish.collectives import all_gather

        ctx.shard = shard
        parts = all_gather(local.contiguous(), group=shard.group, world_size=shard.size)
        return torch.cat(parts, dim=1).index_select(1, shard.order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.index_select(1, ctx.shard.indices), None


def shard_of(bounds: list[int], device) -> ContextShard | None:
    """This rank's `ContextShard` of rows with sequence `bounds` ([0, S] for padded rows, the packed row's
    `cu_seqlens`), or None without context parallelism."""
    from megatron.core import parallel_state as ps

    size = ps.get_context_parallel_world_size()
    if size == 1:
        return None
    return ContextShard.of(bounds, size=size, rank=ps.get_context_parallel_rank(),
                           group=ps.get_context_parallel_group(), device=device)
