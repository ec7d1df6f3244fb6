"""Freeze the config keys and CLI subcommands users depend on: adding is fine, renaming or removing is not."""

from __future__ import annotations

import dataclasses
import typing

from slimish.cli import build_parser
from slimish.config.schema import JobConfig

FROZEN_KEYS = {
    "run.name", "run.output_dir", "run.seed", "model.hf_path", "model.dtype", "parallel.tensor_parallel",
    "parallel.pipeline_parallel", "parallel.expert_parallel", "parallel.num_trainer_ranks", "trainer.micro_batch_size",
    "trainer.num_minibatches", "trainer.optimizer.lr", "trainer.loss.clip_eps_low", "trainer.loss.clip_eps_high",
    "trainer.loss.kl_coef", "sft.steps", "rollout.prompts_per_step", "rollout.samples_per_prompt",
    "rollout.max_new_tokens", "rollout.temperature", "rollout.engine.num_engines", "rollout.router.port",
    "data.path", "reward.fn", "weight_sync.bucket_mb", "rl.num_steps", "rollout.partial.mode",
    "rollout.partial.over_sampling", "rollout.partial.max_staleness", "trainer.loss.tis_cap", "eval.every",
    "eval.data_path", "eval.samples_per_prompt",
}


def _keys(cls, prefix="") -> set[str]:
    keys = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys |= _keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.add(f"{prefix}{f.name}")
    return keys


def test_frozen_config_keys_still_exist():
    assert FROZEN_KEYS <= _keys(JobConfig)


def test_every_config_field_is_documented():
    def walk(cls):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                yield from walk(hints[f.name])
            else:
                yield cls.__name__, f

    undocumented = [f"{owner}.{f.name}" for owner, f in walk(JobConfig) if not f.metadata.get("help")]
    assert not undocumented


def test_cli_subcommands():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"train", "check-config", "make-tiny"} <= set(sub.choices)
