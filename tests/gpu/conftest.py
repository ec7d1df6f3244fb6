"""tests/gpu: what must hold on a real NVIDIA GPU (`make test-gpu`). Without CUDA the Makefile skips them in one
line; `make test-gpu EMULATE=1` runs the same test bodies with SLIMISH_EMULATED_GPU=1, so the trainer processes they
start compute on the emulated GPU (`slimish.compat.emulated_gpu`) and the tests are never dead code.
Collected by the plain `pytest` of `make test` too, where each test skips."""

from __future__ import annotations

import os

import pytest
import torch


def emulated() -> bool:
    return os.environ.get("SLIMISH_EMULATED_GPU", "") == "1"


def device_available() -> bool:
    return torch.cuda.is_available() or emulated()


def pytest_collection_modifyitems(config, items):
    if device_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device (make test-gpu EMULATE=1 runs these on the emulated GPU)")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
