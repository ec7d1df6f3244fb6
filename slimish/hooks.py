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
import inspect
import os
import subprocess
import sys
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
    except SyntaxError as exc:
        raise HookError(f"module {module_name!r} of {dotted!r} has a syntax error: {exc.filename}:{exc.lineno}: "
                        f"{exc.msg}") from None
    except Exception as exc:  # the module's own code failed at import; noqa: BLE001 (it is user code)
        raise HookError(f"module {module_name!r} of {dotted!r} raised at import: {type(exc).__name__}: "
                        f"{' '.join(str(exc).split())[:300]}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise HookError(f"module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise HookError(f"{dotted!r} is not callable")
    return fn


# What each kind of hook is called with (README "Hooks"): positional arguments, then keywords. A reward hook gets
# more keywords (its dataset's columns), which it may take by name or with **kwargs: only these are required.
CALLS = {
    "reward": ((["a completion"],), {"prompts": ["a prompt"], "labels": [None], "samples": []}),
    "program": ((None, None), {}),
    "phase": (("rollout", 1, []), {}),
    "after_bucket": (("1", 0, []), {}),
    "in_flight": (("1", 0, []), {}),
}


def check_signature(fn: Callable, kind: str, dotted: str) -> None:
    """HookError unless `fn` can be called as a hook of `kind` is (a reward hook with extra parameters that name
    dataset columns passes). A rollout program must be an async function."""
    args, kwargs = CALLS[kind]
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: nothing to read
    try:
        if kind == "reward":
            signature.bind_partial(*args, **kwargs)
        else:
            signature.bind(*args, **kwargs)
    except TypeError as exc:
        shown = ", ".join([*(repr(a) for a in args), *(f"{k}=..." for k in kwargs)])
        raise HookError(f"{dotted!r} cannot be called as a {kind} hook is, fn({shown}): {exc} (its signature: "
                        f"{signature})") from None
    if kind == "program" and not inspect.iscoroutinefunction(fn):
        raise HookError(f"{dotted!r} is not an async function: define it with `async def program(sample, client)`")


def check_in_subprocess(dotted: str, kind: str, *, timeout_s: float = 120.0) -> None:
    """`load_function` and `check_signature` in a fresh Python process (`python -m slimish.hooks`), so that a
    module that hangs, exits or crashes at import is reported, never run in the caller. HookError in one line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        result = subprocess.run([sys.executable, "-m", "slimish.hooks", kind, dotted], capture_output=True, text=True,
                                timeout=timeout_s, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise HookError(f"importing {dotted!r} took more than {timeout_s:g}s") from None
    if result.returncode == 0 and "hook ok" in result.stdout.splitlines():
        return
    lines = [line for line in result.stdout.splitlines() if line.startswith("hook error: ")]
    if lines:
        raise HookError(lines[-1].removeprefix("hook error: "))
    tail = " ".join((result.stderr or result.stdout).split())[-300:]
    raise HookError(f"importing {dotted!r} ended its process with exit status {result.returncode}"
                    + (f": {tail}" if tail else ""))


def _main(kind: str, dotted: str) -> int:
    try:
        check_signature(load_function(dotted), kind, dotted)
    # The answer to `check_in_subprocess` on stdout (a protocol line, not a log line).
    except HookError as exc:
        sys.stdout.write(f"hook error: {exc}\n")
        return 2
    sys.stdout.write("hook ok\n")  # a module that exits at import (even with status 0) never gets here
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1], sys.argv[2]))
