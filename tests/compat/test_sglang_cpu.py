"""The environment of a CPU engine (`slimish.compat.sglang_cpu.server_env`)."""

from __future__ import annotations

import pytest

from slimish.compat import sglang_cpu


@pytest.mark.skipif(sglang_cpu.cuda_available(), reason="a CUDA machine: engines keep SGLang's crash diagnostics")
def test_a_cpu_engine_skips_the_crash_diagnostics_a_stop_would_wait_for():
    """SGLang sleeps 5 s before its crash diagnostics, which a stop triggers (the group's SIGTERM ends the scheduler
    first): on a CPU engine there is nothing to dump, so they are off, unless the user set them."""
    env = sglang_cpu.server_env({})
    assert env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "0" and env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    assert sglang_cpu.server_env({"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1"})["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"
