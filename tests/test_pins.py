"""The versions every install path asks for are the lock's: `setup.py` (a GPU install from it, Python 3.12 included,
gets the stack the CPU suite ran on) and the GPU lock (the CPU lock's pins plus Transformer Engine, in the range the
pinned megatron-core declares)."""

from __future__ import annotations

import re
from email.parser import Parser
from importlib.metadata import distribution

from packaging.requirements import Requirement

from tests.conftest import REPO

STACK = ("torch", "megatron-core", "sglang", "sglang-router")


def _pins(path: str) -> dict[str, str]:
    pins = {}
    for line in (REPO / path).read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s;#]+)", line)
        if match:
            pins[match.group(1).lower()] = match.group(3)
    return pins


def test_setup_pins_the_stack_to_the_locked_releases():
    setup, lock = (REPO / "setup.py").read_text(), _pins("requirements/cpu-lock.txt")
    for name in STACK:
        assert f'"{name}=={lock[name]}"' in setup, name


def test_the_gpu_lock_is_the_cpu_lock_plus_transformer_engine_in_megatron_cores_range():
    text = (REPO / "requirements/gpu-lock.txt").read_text()
    assert "-r cpu-lock.txt" in text.splitlines()
    gpu = _pins("requirements/gpu-lock.txt")
    assert set(gpu) == {"transformer-engine"}, "the GPU lock re-pins nothing of the CPU lock"
    metadata = Parser().parsestr(distribution("megatron-core").read_text("METADATA"))
    declared = [Requirement(r) for r in metadata.get_all("Requires-Dist") if r.startswith("transformer-engine")]
    assert declared and all(req.specifier.contains(gpu["transformer-engine"], prereleases=True) for req in declared)
    assert distribution("megatron-core").version == _pins("requirements/cpu-lock.txt")["megatron-core"]
