"""Fill a live Megatron-Core model from HF tensors, and export its parameters as HF-named full tensors.

Both directions walk the same rule table (`dense.model_rules`), so conversion and weight sync cannot disagree.
Loading is strict: an HF tensor left unused or a Megatron parameter left unfilled is an error.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from slimish.megatron_bridge import dense, moe, sharding, slice_read
from slimish.megatron_bridge.errors import MappingError
from slimish.megatron_bridge.hf_config import Architecture
from slimish.megatron_bridge.hf_io import HFCheckpoint


def _named_params(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(raw name, canonical name, tensor) of every weight: each parameter once (a tied output layer shares the
    embedding's), then the buffers that are weights too (`moe.WEIGHT_BUFFERS`: the router's correction bias)."""
    seen: set[int] = set()
    buffers = ((n, b) for n, b in model.named_buffers() if n.endswith(moe.WEIGHT_BUFFERS))
    for name, param in itertools.chain(model.named_parameters(), buffers):
        if id(param) in seen:
            continue
        seen.add(id(param))
        canonical = dense.canonical_megatron_name(name)
        yield name, canonical, param


def _tp_info(*, expert: bool):
    """(rank, size, group) of the tensor-parallel group that shards the parameter; experts have their own."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    if expert:
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group())


def _local_experts(arch: Architecture) -> tuple[int, int]:
    """(first global expert, count) held by this expert-parallel rank."""
    from megatron.core import parallel_state as ps

    if arch.moe is None:
        return 0, 0
    size = ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    rank = ps.get_expert_model_parallel_rank() if size > 1 else 0
    count = arch.moe.num_experts // size
    return rank * count, count


def model_chunks(model) -> list[torch.nn.Module]:
    """A rank's model chunks: `model` itself, or the list of its virtual-pipeline chunks (each a stage of its own,
    with its own layers: Megatron's interleaved schedule)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def _rules_for(model: torch.nn.Module, arch: Architecture) -> dict[str, dense.Rule]:
    """This pipeline stage's rules keyed by local parameter name.

    Stages number their layers from 0; Megatron's `layer_number` (1-based, global) gives the global index, which
    the HF names keep. So every stage loads and exports its own layers under the global HF numbering. Likewise an
    expert-parallel rank numbers its experts from 0 and keeps only the rules of the experts it holds.
    """
    module = _unwrap(model)
    layers = [layer.layer_number - 1 for layer in module.decoder.layers]
    offset = layers[0] if layers else 0
    if layers != list(range(offset, offset + len(layers))):
        raise MappingError(f"non-contiguous decoder layers on this stage: {layers}")
    first_expert, num_experts = _local_experts(arch)
    rules = {}
    for rule in dense.stage_rules(arch, layers=range(offset, offset + len(layers)), first=module.pre_process,
                                  last=module.post_process):
        name = moe.localize_expert(rule.megatron, first=first_expert, count=num_experts)
        if name is None:
            continue
        if name.startswith("decoder.layers."):
            index = int(name.split(".")[2])
            name = name.replace(f"decoder.layers.{index}.", f"decoder.layers.{index - offset}.", 1)
        rules[name] = rule
    return rules


@torch.no_grad()
def load_hf_weights(model, ckpt: HFCheckpoint | str, arch: Architecture) -> int:
    """Copy every parameter of `model` (this rank's shard: a module or a list of model chunks) from the HF
    checkpoint; strict both ways (multi-token prediction layers are skipped by name, see `dense.is_mtp_tensor`).

    Reads only this rank's slice of each tensor (`slice_read`: its layers, its experts, its TP rows or columns).
    Returns how many parameters were read whole anyway (a layout `slice_read` cannot slice); `ckpt.bytes_read`
    counts the bytes."""
    ckpt = HFCheckpoint(ckpt) if not isinstance(ckpt, HFCheckpoint) else ckpt
    used: set[str] = set()
    mapped: set[str] = set()
    fallbacks = 0
    for chunk in model_chunks(model):
        rules = _rules_for(chunk, arch)
        mapped.update(n for r in rules.values() for n in r.hf)
        fallbacks += _load_chunk(chunk, rules, ckpt, arch, used)
    unfilled = mapped - used
    if unfilled:
        raise MappingError(f"HF tensors mapped but never loaded: {sorted(unfilled)[:5]}")
    unknown = dense.unmapped_hf_names(ckpt.names(), arch)
    if unknown:
        raise MappingError(f"HF tensors with no Megatron mapping (would be dropped): {unknown[:5]}")
    return fallbacks


def _load_chunk(model: torch.nn.Module, rules: dict, ckpt: HFCheckpoint, arch: Architecture, used: set[str]) -> int:
    fallbacks = 0
    for raw, canonical, param in _named_params(model):
        rule = rules.get(canonical)
        if rule is None:
            raise MappingError(f"Megatron parameter {raw!r} has no HF mapping for family {arch.family!r}")
        tp_rank, tp_size, _ = _tp_info(expert=moe.is_expert(canonical))
        local, fell_back = slice_read.read_local(rule, param, ckpt, arch, tp_rank=tp_rank, tp_size=tp_size)
        fallbacks += fell_back
        if local.shape != param.shape:
            raise MappingError(f"{raw}: HF {rule.hf} give shape {tuple(local.shape)}, model has {tuple(param.shape)}")
        param.copy_(local.to(param.dtype))
        used.update(rule.hf)
    return fallbacks


@torch.no_grad()
def copy_weights(source, target) -> bool:
    """Copy every weight of the model `source` (a module or its chunks) into `target`, built alike (the reference
    model from the freshly loaded policy: one read of the checkpoint for both). False, copying nothing, when their
    weights differ in names or shapes."""
    pairs = []
    for src_chunk, dst_chunk in itertools.zip_longest(model_chunks(source), model_chunks(target)):
        if src_chunk is None or dst_chunk is None:
            return False
        src = {canonical: param for _, canonical, param in _named_params(src_chunk)}
        dst = {canonical: param for _, canonical, param in _named_params(dst_chunk)}
        if src.keys() != dst.keys() or any(src[n].shape != dst[n].shape for n in src):
            return False
        pairs += [(src[name], dst[name]) for name in dst]
    for src, dst in pairs:
        dst.copy_(src)
    return True


def export_entries(model, arch: Architecture) -> Iterator[tuple[dense.Rule, torch.Tensor, bool]]:
    """(rule, local tensor, is expert) of every parameter this rank exports (of each of its model chunks in turn),
    in model order (replicas skipped). Purely local: no communication."""
    for chunk in model_chunks(model):
        rules = _rules_for(chunk, arch)
        for raw, canonical, param in _named_params(chunk):
            rule = rules.get(canonical)
            if rule is None:
                raise MappingError(f"Megatron parameter {raw!r} has no HF mapping for family {arch.family!r}")
            if not rule.replica:
                yield rule, param, moe.is_expert(canonical)


def gather_full(param: torch.Tensor, rule: dense.Rule, *, expert: bool) -> torch.Tensor:
    """The full (TP-gathered) Megatron tensor of `param`: a collective over its tensor-parallel group."""
    _, tp_size, tp_group = _tp_info(expert=expert)
    return sharding.gather(param.detach(), param, rule.kind, tp_group, tp_size)


@torch.no_grad()
def export_hf_tensors(model, arch: Architecture) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every parameter this pipeline stage owns, in model order, with global layer
    numbers: the union over stages is the whole checkpoint, each tensor exactly once. With expert parallelism each
    rank yields only its own experts (global numbers) besides the parameters every expert-parallel rank holds.

    With tensor parallelism this is a collective: every TP rank must iterate in step. For the whole model on one
    rank (weight sync) see `full_export.export_full_hf_tensors`.
    """
    for rule, param, expert in export_entries(model, arch):
        yield from zip(rule.hf, dense.to_hf(rule, gather_full(param, rule, expert=expert), arch))
