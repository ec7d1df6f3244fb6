"""Megatron's forward / backward schedule over a list of micro-batches, and one optimizer step with it (any
pipeline-parallel size: the same calls on every rank; outputs on the last stage only).

A model here is a rank's list of model chunks: one, or parallel.virtual_pipeline of them (Megatron's interleaved
1F1B schedule runs each micro-batch through every chunk of every stage in turn)."""

from __future__ import annotations

import functools
import math

import torch

from slimish import collectives
from slimish.errors import UserError
from slimish.trainer.batch import MicroBatch
from slimish.trainer.device import module_device


def run_schedule(chunks: list, microbatches: list[MicroBatch], loss_fn, *, forward_only: bool) -> list[dict]:
    """loss_fn(mb, hidden) -> (loss, metrics) on the last stage, where `hidden` is what the model returns there (its
    last hidden states: see `LogprobHead`) and `mb` the micro-batch on the model's device; returns the metrics of
    every micro-batch (empty on other stages). `microbatches` stay in host memory: each goes to the device right
    before its forward, so a step holds one micro-batch's data on the device at a time. With several chunks
    (interleaved 1F1B, Megatron's groups of pipeline_parallel micro-batches) their count must be a multiple of
    pipeline_parallel, and they all of one shape (`rl_step.plan` and `rl_step.collate_minibatch` make them so)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from slimish.trainer.attention import packed_bounds_device  # imports Megatron: not at the driver's import
    from slimish.trainer.context_parallel import shard_of

    device = module_device(chunks[0])
    bounds_device = packed_bounds_device(chunks[0])

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator).to(device, non_blocking=True)
        tokens, positions = mb.tokens, mb.position_ids
        # Context parallelism: the model runs this rank's share of every sequence; the heads make it whole again.
        mb.shard = shard_of(mb.sequence_bounds(), device)
        if mb.shard is not None:
            tokens, positions = mb.shard.take(tokens), mb.shard.take(positions)
        # No mask: every attention is causal within a row or a packed sample (`slimish.trainer.attention`).
        hidden = chunk(tokens, positions, None, packed_seq_params=mb.packed_seq_params(bounds_device))
        return hidden, functools.partial(loss_fn, mb)

    # Interleaved: every chunk reads the micro-batches in order.
    iterators = [iter(microbatches) for _ in chunks] if len(chunks) > 1 else iter(microbatches)
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators, model=list(chunks),
        num_microbatches=len(microbatches), seq_length=max(mb.tokens.shape[1] for mb in microbatches),
        micro_batch_size=max(mb.tokens.shape[0] for mb in microbatches), forward_only=forward_only)


def optimizer_step(chunks: list, optimizer, microbatches: list[MicroBatch], loss_fn,
                   lr_schedule=None) -> tuple[list[dict], float]:
    """Zeroed grads, forward and backward over `microbatches`, one optimizer step: (metrics, grad norm). With
    `lr_schedule` (`slimish.trainer.lr_schedule`), it is advanced right before the optimizer step: step k trains at
    the schedule's lr(k). A step whose gradients are not finite on any rank (a NaN or inf loss, an overflow) is not
    applied: the weights, the optimizer's moments and the schedule stay as they were, the grads are dropped, and the
    grad norm returned is NaN (`step_applied` tells). Megatron's optimizers check this only with fp16's loss scaler."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = run_schedule(chunks, microbatches, loss_fn, forward_only=False)
    if not grads_finite(chunks):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        return outputs, float("nan")
    if lr_schedule is not None:
        lr_schedule.step(1)
    _, grad_norm, _ = optimizer.step()
    return outputs, float(grad_norm or 0.0)


def step_applied(grad_norm: float) -> bool:
    """Whether the step `optimizer_step` returned `grad_norm` for changed the weights."""
    return not math.isnan(grad_norm)  # NaN only for a step it did not apply


class NonFiniteWeights(UserError):
    """The model's weights hold NaN or inf: they must not reach the engines or a checkpoint."""


def check_weights_finite(chunks: list, *, doing: str) -> None:
    """Raise `NonFiniteWeights` on every trainer rank if any rank's parameters of `chunks` hold a NaN or an inf
    (collective: every rank calls it). `doing` says what was refused ("saving checkpoint step_3"). Guarded steps
    (`optimizer_step`) keep non-finite gradients out; this catches what still gets through (an optimizer's own
    overflow, a weight loaded from a bad file) before it is synced or saved over the good checkpoints."""
    # Counted on the device, one transfer for the lot (as `grads_finite`): not a host sync per parameter.
    params = [(name, param) for chunk in chunks for name, param in chunk.named_parameters()]
    bad = torch.zeros((), dtype=torch.float32, device=module_device(chunks[0]))
    for _, param in params:
        bad += (~torch.isfinite(param.detach())).any().to(torch.float32)
    total = int(collectives.all_reduce(bad, op="sum").item())
    if total:  # the error path: name this rank's first bad tensor
        first_bad = next((name for name, param in params if not torch.isfinite(param.detach()).all()), None)
        first = f" (first here: {first_bad})" if first_bad else ""
        raise NonFiniteWeights(f"{total} weight tensor(s) hold NaN or inf{first}: not {doing}. The last good "
                               "checkpoint is untouched: resume from it with a lower trainer.optimizer.lr")


def grads_finite(chunks: list) -> bool:
    """Whether every gradient of the model is finite on every trainer rank: one check per gradient buffer of
    Megatron's DDP (the reduced grads, or with the distributed optimizer this rank's reduced shard beside its own
    unreduced rest: a non-finite value anywhere reaches some rank's buffer), then the worst over all ranks."""
    # Megatron's DDP keeps its buffers in lists under these names (shadowing nn.Module.buffers); a bare module has none.
    buffers = [b for model in chunks for name in ("buffers", "expert_parallel_buffers")
               if isinstance(found := getattr(model, name, None), list) for b in found]
    grads = [b.grad_data for b in buffers] or [p.main_grad if hasattr(p, "main_grad") else p.grad
                                              for model in chunks for p in model.parameters()]
    device = module_device(chunks[0])
    bad = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        if grad is not None:
            bad = torch.maximum(bad, (~torch.isfinite(grad)).any().to(torch.float32))
    return collectives.all_reduce(bad, op="max").item() == 0
