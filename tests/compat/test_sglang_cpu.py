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


def test_the_plugin_is_registered_where_sglang_looks_for_plugins():
    from importlib.metadata import entry_points

    assert "slimish.compat.sglang_plugin:register" in [ep.value for ep in entry_points(group="sglang.srt.plugins")]


@pytest.mark.skipif(sglang_cpu.cuda_available(), reason="a CUDA machine: the plugin changes nothing there")
@pytest.mark.parametrize("cpu_engine", [True, False])
def test_the_plugin_makes_a_cpu_engines_device_synchronisation_a_no_op(cpu_engine):
    """SGLang's /release_memory_occupation synchronises torch.cuda on a CPU engine, which raised there and took the
    server down; in a CPU engine's processes the plugin makes that call do nothing, elsewhere it changes nothing.
    (In a process of its own: the plugin changes torch where it runs.)"""
    import subprocess
    import sys

    code = ("import torch; from slimish.compat.sglang_plugin import register; register()\n"
            "try:\n    torch.cuda.synchronize(); print('no-op')\nexcept RuntimeError as exc:\n    print('raised')")
    env = sglang_cpu.server_env() if cpu_engine else {k: v for k, v in sglang_cpu.server_env().items()
                                                       if k != "SGLANG_USE_CPU_ENGINE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == ("no-op" if cpu_engine else "raised"), out.stderr[-2000:]


def test_a_colocated_gpu_engine_asks_for_sglangs_memory_saver():
    """Colocated on a GPU, the engine's release frees memory only with SGLang's memory saver: the flag, as SGLang's
    own parser reads it; on the CPU (where the saver cannot start) it is left out."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    gpu = sglang_cpu.server_args(device="cuda", dtype="bfloat16", colocated=True)
    assert parser.parse_args(["--model-path", "m", *gpu]).enable_memory_saver
    assert not parser.parse_args(["--model-path", "m", *sglang_cpu.server_args(device="cuda", dtype="bfloat16")]
                                 ).enable_memory_saver
    assert "--enable-memory-saver" not in sglang_cpu.server_args(device="cpu", dtype="float32", colocated=True)
