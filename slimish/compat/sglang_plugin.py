"""slimish's SGLang plugin, through SGLang's own plugin mechanism (entry point group `sglang.srt.plugins`, declared in
setup.py): SGLang runs `register()` early in each of its processes (HTTP server, scheduler, detokenizer). It does
nothing unless the process is a CPU engine (`SGLANG_USE_CPU_ENGINE=1`, which `sglang_cpu.server_env` sets only
where CUDA is absent) on a machine without a usable GPU.

What it changes there:
- `torch.cuda.synchronize` does nothing. SGLang synchronises "the device" through `torch.get_device_module()`,
  which is `torch.cuda` in a CUDA build of torch even where no GPU is present, so on a CPU engine the call raises
  "Found no NVIDIA driver"; raised in a scheduler, it takes the whole server down. This is what
  `/release_memory_occupation` did (every tag; SGLang 0.5.23, scheduler_components/weight_updater.py), which a
  colocated job calls every step. On a CPU engine there is no device work to wait for, so nothing is skipped: only
  calls that would have raised change.
- The server forks its scheduler and detokenizer processes instead of spawning them (a hook, SGLang's
  `HookRegistry`, after `sglang.srt.entrypoints.engine._set_envs_and_config`, which forces "spawn"). Spawning is
  what CUDA needs (a forked child cannot use its parent's CUDA context); a CPU engine has none, and a spawned child
  imports SGLang again from nothing: on a 2-core machine that was 18 of an engine's 43 s to start (22 s forked),
  more with two ranks. The children are the same code with the same arguments; only how they come to exist differs.
"""

from __future__ import annotations

import multiprocessing
import os

START_METHOD_TARGET = "sglang.srt.entrypoints.engine._set_envs_and_config"


def register() -> None:
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return
    import torch

    if torch.cuda.is_available():
        return
    torch.cuda.synchronize = _nothing_to_synchronize
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(START_METHOD_TARGET, _fork_the_engines_processes, HookType.AFTER)


def _nothing_to_synchronize(device=None) -> None:
    """A CPU engine's device synchronisation: its work is done when the call that made it returns."""


def _fork_the_engines_processes(result, *args, **kwargs):
    """After SGLang has set its process start method ("spawn"): "fork" instead, for the processes it starts next."""
    multiprocessing.set_start_method("fork", force=True)
    return result
