"""The one resolver for user hooks named by a dotted path in the config.

Hooks and their contracts (see README "Hooks"):
  reward.fn   fn(completions: list[str], **kwargs) -> list[float]
              kwargs: prompts (list[str]), labels (list), samples (list[Sample])
  rollout.generate_fn
              async fn(sample: Sample, client: RolloutClient) -> Sample | list[Sample]
              a rollout program: multi-turn generation, tools (slimish/rollout/programs.py)
  weight_sync.after_bucket_hook
              fn(version: str, bucket: int, engine_urls: list[str]) -> None
              on the sending trainer rank, after bucket number `bucket` (0-based; not the last) of the sync to
              `version` is on its way to `engine_urls`
  run.phase_hook
              fn(phase: str, step: int, engine_urls: list[str]) -> None
              in the driver, as phase 'rollout', 'train' or 'sync' of RL step `step` begins; `engine_urls` are the
              engines of the last weight sync
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from slimish.errors import UserError


class HookError(UserError, ValueError):
    """A dotted path that does not resolve to a callable."""


def load_function(dotted: str) -> Callable:
    module_name, _, attr = dotted.rpartition(".")
    if not module_name:
        raise HookError(f"{dotted!r} is not a dotted path 'module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HookError(f"cannot import module {module_name!r} of {dotted!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise HookError(f"module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise HookError(f"{dotted!r} is not callable")
    return fn
