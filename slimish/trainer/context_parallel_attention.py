"""Context-parallel attention without Transformer Engine: every rank all-gathers the keys and values of the group.

On a GPU with Transformer Engine, context parallelism runs TE's attention (ring / all-gather / all-to-all exchanges,
`parallel.cp_comm_type`). Where TE is absent (the CPU, the emulated GPU, a bare GPU) this module takes its place at
that one boundary (it is TE's kernel that cannot run here, not the exchange), so that everything around it runs for
real: the load-balanced split of every sequence
(`slimish.trainer.context_parallel`), Megatron's RoPE positions for each rank's chunks, the packed sequence bounds,
the heads' gather and the gradients' reduction over the data x context-parallel group. It is TE's `all_gather`
exchange in plain torch: each rank gathers the keys and values of the whole sequence (their gradients summed back
over the group in the backward pass) and attends from its own two chunks of each sequence, each query chunk to the
keys up to its own positions (`SdpaAttention._attend`, causal aligned to the lower right). It holds the group's
keys and values for one layer at a time: memory linear in the sequence, not S x S.
"""

from __future__ import annotations

import functools

import torch

from slimish.trainer.attention import SdpaAttention
from slimish.trainer.context_parallel import ContextShard


class _AllGather(torch.autograd.Function):
    """Rank-major concatenation along dim 0 of every rank's tensor; the backward sums the gradient over the group
    (every rank's queries attended to every rank's keys) and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        from slimish.collectives import all_gather

        ctx.group, ctx.rank, ctx.length = group, rank, tensor.shape[0]
        return torch.cat(all_gather(tensor.contiguous(), group=group, world_size=size), dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from slimish.collectives import all_reduce

        total = all_reduce(grad.contiguous(), group=ctx.group)
        return total[ctx.rank * ctx.length:(ctx.rank + 1) * ctx.length], None, None, None


@functools.lru_cache(maxsize=4)
def _row_order(bounds: tuple[int, ...], size: int, rank: int, device) -> torch.Tensor:
    """`ContextShard.order` of a micro-batch's bounds: built once per micro-batch, not once per layer (every layer
    of a micro-batch, forward and backward recompute alike, sees the same bounds)."""
    return ContextShard.of(list(bounds), size=size, rank=rank, group=None, device=device).order


class ContextParallelSdpaAttention(SdpaAttention):
    """`SdpaAttention` over the context-parallel group's keys and values (see the module docstring). Input: this
    rank's tokens, [s_local, b, heads, dim] for padded rows (each row one sequence) or [t_local, heads, dim] for a
    packed row, whose `packed_seq_params.cu_seqlens_q` are the whole row's bounds (on the host: no device sync)."""

    takes_context_parallel = True

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core import parallel_state as ps

        if attention_bias is not None:
            raise ValueError("context-parallel SDPA takes no attention bias")
        size, rank, group = (ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(),
                             ps.get_context_parallel_group())
        packed = packed_seq_params is not None
        bounds = packed_seq_params.cu_seqlens_q.tolist() if packed else [0, query.shape[0] * size]
        order = _row_order(tuple(bounds), size, rank, key.device)
        # The whole rows' keys and values, in row order.
        keys = _AllGather.apply(key, group, rank, size).index_select(0, order)
        values = _AllGather.apply(value, group, rank, size).index_select(0, order)
        outputs, offset = [], 0
        for start, end in zip(bounds[:-1], bounds[1:]):
            chunk = (end - start) // (2 * size)
            for c in (rank, 2 * size - 1 - rank):
                last = start + (c + 1) * chunk  # this chunk's queries see the sequence's keys up to here
                q = query[offset:offset + chunk]
                offset += chunk
                outputs.append(self._attend_rows(q, keys[start:last], values[start:last], packed))
        out = torch.cat(outputs, dim=0)
        return out.reshape(query.shape[0], -1) if packed else out.reshape(query.shape[0], query.shape[1], -1)

    def _attend_rows(self, query, key, value, packed: bool):
        """`_attend` on sequence-first tensors: [s, b, h, d] (padded) or [t, h, d] (one packed sequence's)."""
        if packed:
            query, key, value = (x.transpose(0, 1)[None] for x in (query, key, value))
            return self._attend(query, key, value)[0].transpose(0, 1)
        query, key, value = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        return self._attend(query, key, value).permute(2, 0, 1, 3)
