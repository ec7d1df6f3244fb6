"""slimish's SGLang plugin, through SGLang's own plugin mechanism (entry point group `sglang.srt.plugins`, declared in
setup.py): SGLang runs `register()` early in each of its processes (HTTP server, scheduler, detokenizer). It does
nothing unless the process is a CPU engine (`SGLANG_USE_CPU_ENGINE=1`, which `sglang_cpu.server_env` sets only
where CUDA is absent) on a machine without a usable GPU.

What it changes there: `torch.cuda.synchronize` does nothing. SGLang synchronises "the device" through
`torch.get_device_module()`, which is `torch.cuda` in a CUDA build of torch even where no GPU is present, so on a CPU
engine the call raises "Found no NVIDIA driver"; raised in a scheduler, it takes the whole server down. This is
what `/release_memory_occupation` did (every tag; SGLang 0.5.23, scheduler_components/weight_updater.py), which a
colocated job calls every step. On a CPU engine there is no device work to wait for, so nothing is skipped: only
calls that would have raised change.
"""

from __future__ import annotations

import os


def register() -> None:
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return
    import torch

    if torch.cuda.is_available():
        return
    torch.cuda.synchronize = _nothing_to_synchronize


def _nothing_to_synchronize(device=None) -> None:
    """A CPU engine's device synchronisation: its work is done when the call that made it returns."""
