"""The whole model as HF tensors on one rank (the weight-sync source), from a TP x PP x EP sharded Megatron model.

`export_full_hf_tensors` is a collective over the ranks of one model replica (`in_source_replica`: the
tensor-parallel group of each pipeline stage, and its experts' expert-tensor x expert-parallel group, which differ
when expert_tensor_parallel x expert_parallel != tensor_parallel): each of them must iterate it to the end. The
source rank (tp = etp = pp = ep = 0) yields every HF tensor of the model exactly once, full, in a fixed order
(stage by stage; within a stage model order, a layer's experts in global order); every other rank yields nothing.
One tensor moves at a time: a parameter outside the experts is gathered over its TP group, an expert's over its
expert-tensor-parallel (ETP) group, an expert travels from its expert-parallel rank to expert-parallel rank 0
(send/recv), and each later stage's leader (tp = etp = ep = 0) sends its tensors to the source after one metadata
message (names, shapes, dtypes). Other data-parallel and expert-data-parallel replicas hold copies and skip it.
The same code runs on gloo (CPU) and NCCL (GPU): receive buffers live on the parameters' device.
`export_owned_hf_tensors` is the same collective with every expert left on the rank that holds it and every stage's
tensors left on its leader (the weight sync's several senders).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slimish import collectives
from slimish.megatron_bridge import dense, sharding
from slimish.megatron_bridge.bridge import _tp_info, export_entries, export_hf_tensors, gather_full, model_chunks
from slimish.megatron_bridge.hf_config import Architecture

Meta = tuple[str, tuple[int, ...], torch.dtype]  # (hf name, shape, dtype)


@dataclass(frozen=True)
class _Ranks:
    tp: int
    etp: int
    ep: int
    ep_size: int
    ep_group: object
    ep_ranks: list[int]
    pp: int
    pp_size: int
    pp_group: object
    pp_ranks: list[int]
    tp_size: int
    expert_group_size: int  # ETP x EP: the ranks that hold one copy of a layer's experts between them
    offset: int  # this rank's place in its replica (`replica_size` consecutive ranks of its pipeline stage)

    @classmethod
    def current(cls) -> _Ranks | None:
        """This rank's place in Megatron's groups, or None when there is no parallelism to undo."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return None
        ep_group, pp_group = ps.get_expert_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        tp, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        ep_size = ps.get_expert_model_parallel_world_size()
        expert_group_size = ps.get_expert_tensor_parallel_world_size() * ep_size
        # Megatron's default order (tp-cp-ep-dp-pp) numbers a stage's ranks TP first, then DP (the experts': ETP
        # first, then EP, then EDP): a replica is lcm(TP, ETP x EP) consecutive ranks, whole TP and ETP x EP groups.
        index = tp + tp_size * ps.get_data_parallel_rank()
        return cls(tp=tp, etp=ps.get_expert_tensor_parallel_rank(), ep=ps.get_expert_model_parallel_rank(),
                   ep_size=ep_size, ep_group=ep_group, ep_ranks=dist.get_process_group_ranks(ep_group),
                   pp=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
                   pp_group=pp_group, pp_ranks=dist.get_process_group_ranks(pp_group), tp_size=tp_size,
                   expert_group_size=expert_group_size, offset=index % math.lcm(tp_size, expert_group_size))

    @property
    def stage_leader(self) -> bool:
        """The first rank of its replica's stage (tp = etp = ep = 0), where the stage's tensors end."""
        return self.offset == 0

    @property
    def dense(self) -> bool:
        """Whether this rank takes part in the gathers of the parameters outside the experts: the first
        tensor-parallel group of its replica (the replica's other TP groups hold copies)."""
        return self.offset < self.tp_size

    @property
    def experts(self) -> bool:
        """Whether this rank takes part in the experts' gathers and sends: the first expert-tensor x expert-parallel
        group of its replica (the others hold copies)."""
        return self.offset < self.expert_group_size


def in_source_replica() -> bool:
    """True on the ranks that take part in the export that reaches the engines, whose source is global rank 0: the
    tensor-parallel group of each of its pipeline stages (data-parallel rank 0) for the parameters outside the
    experts, and their expert-tensor x expert-parallel group (expert-data-parallel rank 0) for the experts. These
    are one group when expert_tensor_parallel x expert_parallel = tensor_parallel, else they differ (one may be
    larger than the other). Every group the export uses lies inside these ranks, so others may skip it. (Every rank
    may also run the export: each replica of lcm(TP, ETP x EP) ranks per stage then exports to its own first rank.)"""
    from megatron.core import parallel_state as ps

    # Context-parallel ranks hold replicas of the weights as data-parallel ranks do: rank 0 of the two together.
    return (not ps.model_parallel_is_initialized() or ps.get_data_parallel_rank(with_context_parallel=True) == 0
            or ps.get_expert_data_parallel_rank() == 0)


def _full_shape(param: torch.Tensor, *, expert: bool) -> list[int]:
    _, tp_size, _ = _tp_info(expert=expert)
    shape = list(param.shape)
    if tp_size > 1 and sharding.is_tp_sharded(param):
        shape[param.partition_dim] *= tp_size
    return shape


def _hf_meta(rule: dense.Rule, param: torch.Tensor, expert: bool, arch: Architecture) -> list[Meta]:
    """The rule's HF (name, shape, dtype)s, worked out on the meta device (no data, no communication)."""
    full = torch.empty(_full_shape(param, expert=expert), dtype=param.dtype, device="meta")
    return [(name, tuple(t.shape), t.dtype) for name, t in zip(rule.hf, dense.to_hf(rule, full, arch))]


def _stage_order(entries: list, ep_size: int, *, dense_first: bool = False) -> list[tuple[int | None, int]]:
    """Stream order of a stage as (source expert-parallel rank or None for a replicated parameter, entry index):
    model order, each layer's expert block repeated per expert-parallel rank, so experts come in global order;
    `dense_first`: every parameter outside the experts first (their gathers done before any expert is yielded)."""
    order: list[tuple[int | None, int]] = []

    def block_key(item):
        rule, _, expert = item[1]
        return rule.megatron.split(".local_experts.")[0] if expert else None

    for key, block in itertools.groupby(enumerate(entries), key=block_key):
        indices = [index for index, _ in block]
        if key is None:
            order += [(None, index) for index in indices]
        else:
            order += [(src, index) for src in range(ep_size) for index in indices]
    if dense_first:
        order = [item for item in order if item[0] is None] + [item for item in order if item[0] is not None]
    return order


def _stage_tensors(entries: list, order: list, metas: list[list[list[Meta]]], ranks: _Ranks,
                   arch: Architecture, owners: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of this stage, yielded on the stage leader only; a collective over the stage's TP and EP
    groups (every rank of the stage iterates it to the end). `owners`: each expert is yielded by the rank that
    holds it (ETP rank 0 of its EP rank), not sent to EP rank 0."""
    for src, index in order:
        rule, param, expert = entries[index]
        if src is None:  # outside the experts: gathered over the source's TP group, the other groups skip together
            if ranks.dense:
                full = gather_full(param, rule, expert=False)
                if ranks.stage_leader:
                    yield from zip(rule.hf, dense.to_hf(rule, full, arch))
        elif not ranks.experts:
            continue
        elif ranks.ep == src:  # gathered over its ETP group, whose rank 0 holds it whole
            full = gather_full(param, rule, expert=True)
            if (src == 0 and ranks.stage_leader) or (owners and ranks.etp == 0):
                yield from zip(rule.hf, dense.to_hf(rule, full, arch))
            elif src != 0 and ranks.etp == 0:
                collectives.send(full.contiguous(), dst=ranks.ep_ranks[0], group=ranks.ep_group)
        elif ranks.ep == 0 and ranks.etp == 0 and not owners:
            # Every expert-parallel rank holds the same local structure: only the names differ.
            full = torch.empty(_full_shape(param, expert=True), dtype=param.dtype, device=param.device)
            collectives.recv(full, src=ranks.ep_ranks[src], group=ranks.ep_group)
            names = [name for name, _, _ in metas[src][index]]
            yield from zip(names, dense.to_hf(rule, full, arch))


def _stage_stream(model: torch.nn.Module, arch: Architecture, ranks: _Ranks, owners: bool = False):
    """(this stage's stream of HF tensors, on its leader only; the stage's plan: every (name, shape, dtype) in
    stream order; the names of its parameters outside the experts). Collective over the stage's EP group (the expert
    names) when expert-parallel. `owners`: as `export_owned_hf_tensors`."""
    entries = list(export_entries(model, arch))
    local_metas = [_hf_meta(rule, param, expert, arch) for rule, param, expert in entries]
    metas = [local_metas]
    if ranks.ep_size > 1 and ranks.experts:  # the leader needs the other ranks' expert names (one message per rank)
        metas = [None] * ranks.ep_size
        dist.all_gather_object(metas, local_metas, group=ranks.ep_group)
    order = _stage_order(entries, ranks.ep_size, dense_first=owners)
    plan = [meta for src, index in order for meta in metas[src or 0][index]]
    dense = {name for src, index in order if src is None for name, _, _ in local_metas[index]}
    return _stage_tensors(entries, order, metas, ranks, arch, owners), plan, dense


@torch.no_grad()
def export_stage_hf_tensors(model: torch.nn.Module, arch: Architecture) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) of this rank's pipeline stage on the stage's leader (tp = etp = ep = 0), each exactly
    once; nothing on the stage's other ranks. A collective over the stage's TP, ETP and EP groups of the source
    replica (`in_source_replica`): all of them iterate it.
    Without pipeline parallelism this is the whole model (`export_full_hf_tensors`)."""
    ranks = _Ranks.current()
    if ranks is None:
        yield from export_hf_tensors(model, arch)
        return
    yield from _stage_stream(model, arch, ranks)[0]


def is_stage_leader() -> bool:
    """True on the rank that holds its pipeline stage's tensors at the end of `export_stage_hf_tensors`."""
    ranks = _Ranks.current()
    return ranks is None or ranks.stage_leader


def stage_leader_rank(stage: int) -> int:
    """Global rank of the leader of pipeline stage `stage` in this rank's pipeline group."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0
    return dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[stage]


@torch.no_grad()
def export_full_hf_tensors(model: torch.nn.Module, arch: Architecture) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) of the whole model on the source rank (tp = etp = pp = ep = 0), each HF tensor exactly
    once; nothing on the other ranks. A collective over the replica's TP, ETP, PP and EP groups (`in_source_replica`):
    all of them iterate it."""
    ranks = _Ranks.current()
    if ranks is None:
        yield from export_hf_tensors(model, arch)
        return
    stage, plan, _ = _stage_stream(model, arch, ranks)
    if ranks.pp_size == 1 or not ranks.stage_leader:
        yield from stage  # items only on the source (without PP the stage leader is the source)
        return
    source = ranks.pp_ranks[0]
    if ranks.pp != 0:
        dist.send_object_list([plan], dst=source, group=ranks.pp_group)
        for item, meta in itertools.zip_longest(stage, plan):
            if item is None or meta is None or item[0] != meta[0]:
                raise RuntimeError(f"stage {ranks.pp} streamed {item and item[0]!r} where its plan says {meta!r}")
            collectives.send(item[1].contiguous(), dst=source, group=ranks.pp_group)
        return
    yield from stage
    device = next(model_chunks(model)[0].parameters()).device
    for stage_rank in ranks.pp_ranks[1:]:
        box = [None]
        dist.recv_object_list(box, src=stage_rank, group=ranks.pp_group)
        for name, shape, dtype in box[0]:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            collectives.recv(tensor, src=stage_rank, group=ranks.pp_group)
            yield name, tensor


class OwnedExport:
    """`export_owned_hf_tensors`' stream on one rank, with `dense_over`: whether this rank's part in the gathers of
    its stage's parameters outside the experts has ended (they come first). Once a stage's leader reports it, every
    rank of the stage has done those gathers too, and the rest of each rank's iteration gathers only over its own ETP
    group: so a sender of the stage waiting for the engines no longer holds up another's export."""

    def __init__(self, items: Iterator[tuple[str, torch.Tensor]], dense_names: set[str]):
        self._items, self._dense_left = items, set(dense_names)
        self.dense_over = not self._dense_left

    @torch.no_grad()
    def __iter__(self):
        for name, tensor in self._items:
            self._dense_left.discard(name)
            self.dense_over = not self._dense_left
            yield name, tensor
        self.dense_over = True


@torch.no_grad()
def export_owned_hf_tensors(model: torch.nn.Module, arch: Architecture) -> OwnedExport:
    """The whole model, each HF tensor exactly once, spread over the ranks that own it (the weight sync's senders,
    `slimish.weight_sync.owners`): each pipeline stage's leader (tp = etp = ep = 0; global rank 0 for the first
    stage) yields its stage's parameters outside the experts and its own experts; ETP rank 0 of every other EP rank
    of the source replica yields its own experts, which no longer travel to EP rank 0; other ranks yield nothing, and
    nothing crosses the pipeline group. Within a stage every parameter outside the experts comes first (see
    `OwnedExport.dense_over`). A collective over each stage's TP, ETP and EP groups of the source replica, as
    `export_full_hf_tensors`."""
    ranks = _Ranks.current()
    if ranks is None:
        return OwnedExport(export_hf_tensors(model, arch), set())
    stream, _, dense = _stage_stream(model, arch, ranks, owners=True)
    return OwnedExport(stream, dense if ranks.stage_leader else set())


def owns_in_owned_export() -> bool:
    """Whether this rank yields anything in `export_owned_hf_tensors` (it is then one of the weight sync's senders):
    a stage's leader, or ETP rank 0 of an expert-parallel rank of the source replica's expert group."""
    ranks = _Ranks.current()
    if ranks is None:
        return True
    return in_source_replica() and (ranks.stage_leader or (ranks.ep_size > 1 and ranks.experts and ranks.etp == 0))
