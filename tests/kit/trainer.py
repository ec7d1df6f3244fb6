"""A trainer rank for tests, driven through its public entry points (`slimish.trainer.rl_step`, `TrainerWorker`).

`make_worker` builds a set-up `TrainerWorker` from the quickstart config; `rl_step` runs one step of it with the
configured estimator or with advantages the test fixes (`given_advantages`: the estimator's settings, its values
replaced); `response_logprobs` reads the trainer's logprobs of samples; `export_state` copies its whole model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from slimish.config import load_config
from slimish.sample import Sample
from slimish.trainer import rl_step as steps
from slimish.trainer.estimators import Estimator

REPO = Path(__file__).resolve().parents[2]


def make_worker(*overrides: str, rank: int = 0, world_size: int = 1, master_port: int = 0):
    """A set-up TrainerWorker on configs/quickstart_cpu.yaml with `overrides` (model.hf_path, data.path, ...). With
    one rank the process group must already exist (the `megatron_world` fixture); else the ranks meet at
    127.0.0.1:`master_port`."""
    from slimish.trainer.worker import TrainerWorker

    cfg = load_config(REPO / "configs/quickstart_cpu.yaml", ["eval.every=0", "sft.steps=0", *overrides])
    worker = TrainerWorker(cfg, rank=rank, world_size=world_size)
    worker.setup(master_addr="127.0.0.1", master_port=master_port)
    return worker


def task_overrides(task_assets: dict) -> list[str]:
    """The overrides that point the quickstart config at the `task_assets` fixture's model and data."""
    return [f"model.hf_path={task_assets['model']}", f"data.path={task_assets['train']}",
            f"sft.data_path={task_assets['sft']}"]


def given_advantages(estimator: Estimator, per_sample: list[float]) -> Estimator:
    """`estimator` with its advantages replaced by `per_sample[i]` on every response token of step sample i (its
    ratio level, aggregation and critic returns kept)."""
    def fixed(inputs, _cfg) -> list[torch.Tensor]:
        return [torch.full_like(mask, float(per_sample[i])) for i, mask in zip(inputs.indices, inputs.masks)]

    return dataclasses.replace(estimator, advantages=fixed)


def rl_step(worker, samples: list[Sample], advantages: list[float] | None = None, *,
            policy_version: int | None = None) -> dict:
    """One RL step: prepare -> advantages (`advantages`, one per sample, or the configured estimator's from the
    samples' rewards) -> train. Returns the step's metrics and, under "advantage_means", each sample's mean."""
    ctx = worker.step
    batch, metrics = steps.prepare(ctx, samples, policy_version=policy_version)
    estimator = given_advantages(ctx.estimator, advantages) if advantages is not None else None
    means = steps.advantages(ctx, batch, estimator)
    return {**metrics, **steps.train(ctx, batch), "advantage_means": means}


def response_logprobs(worker, samples: list[Sample]) -> tuple[torch.Tensor | None, list[int]]:
    """[samples of this rank, response length]: the trainer's logprobs of each response (equal lengths; None where
    there are none: a pipeline stage other than the last), and which of `samples` they are, in that order."""
    batch, _ = steps.prepare(worker.step, samples)
    out = batch.local_responses("old_logprobs")
    return (torch.stack(out) if out else None), list(batch.indices)


def logprobs_by_sample(worker, samples: list[Sample]) -> list[torch.Tensor]:
    """The trainer's response logprobs of each of `samples`, in their order (responses may differ in length)."""
    batch, _ = steps.prepare(worker.step, samples)
    found = batch.local_responses("old_logprobs")
    return [found[batch.indices.index(i)] for i in range(len(samples))]


def export_state(worker) -> dict[str, torch.Tensor]:
    """HF-named copy of the worker's whole model on rank 0 (empty elsewhere); every rank must call it (the export's
    gathers span the source replica)."""
    from slimish.megatron_bridge.full_export import export_full_hf_tensors, in_source_replica

    if not in_source_replica():
        return {}
    return {name: t.clone() for name, t in export_full_hf_tensors(worker.step.policy.chunks, worker.arch)}
