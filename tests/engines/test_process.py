"""`ManagedProcess.stopped`: the processes of a server's group that are stopped (state T in /proc), as the watchdog
reads them to find a frozen engine, on a real process."""

from __future__ import annotations

import os
import signal
import sys
import time

from slimish.engines.process import ManagedProcess


def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    """The kernel stops and continues a process asynchronously: wait for the state, not for a time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_stopped_process_is_reported_until_it_is_continued(tmp_path):
    proc = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], env=dict(os.environ),
                          log_path=tmp_path / "sleeper.log")
    proc.start()
    try:
        assert proc.stopped() == []
        os.kill(proc.pid, signal.SIGSTOP)
        assert wait_until(lambda: proc.stopped() == [proc.pid])
        os.kill(proc.pid, signal.SIGCONT)
        assert wait_until(lambda: proc.stopped() == [])
    finally:
        proc.stop(grace_s=2)
    assert not proc.alive()


def test_the_commands_of_its_group_are_listed(tmp_path):
    """`commands` names what the server's group runs now: here a shell and the `sleep` it started (an engine's would
    show `nvcc` or `ninja` while a JIT compiles kernels: slimish.engines.startup)."""
    proc = ManagedProcess("shell", ["bash", "-c", "sleep 120 & wait"], env=dict(os.environ),
                          log_path=tmp_path / "shell.log")
    proc.start()
    try:
        assert wait_until(lambda: proc.commands() == ["bash", "sleep"]), proc.commands()
    finally:
        proc.stop(grace_s=2)
    assert proc.commands() == []


def test_an_engine_that_is_not_up_says_what_it_waits_for():
    from slimish.engines.startup import waiting_for

    compiling = waiting_for(["ninja", "nvcc", "python3", "sglang::schedul"], part=0)
    assert compiling.startswith("compiling CUDA kernels (ninja, nvcc running in it")
    assert "python -m flashinfer download-kernels" in compiling and "startup_timeout_s" in compiling
    assert waiting_for(["python3", "sglang::schedul"], part=0).startswith("its first generation (/health_generate)")
    assert waiting_for(["python3"], part=1).startswith("its schedulers (a node part's /health)")
