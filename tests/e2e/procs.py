"""Find processes a test started that are still alive (engines, router, Ray, trainer workers).

The test process makes itself a child subreaper, so every process the job started that outlives its parent is
re-parented to the test process instead of PID 1: its descendants are then exactly what the job left behind,
whatever else runs on the machine, less those it already had when it became one (its own helpers: e.g. the
`torch_shm_manager` torch starts for a process that shares memory by name, here when an earlier test ran the
`tensor` weight-sync transport in the test process; it lives as long as that process).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

import psutil

_PR_SET_CHILD_SUBREAPER = 36
_already_running: set[int] = set()  # this process's descendants when the job under test had not started yet


def become_subreaper() -> None:
    """Call before starting the job under test."""
    if ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    _already_running.clear()
    _already_running.update(child.pid for child in psutil.Process(os.getpid()).children(recursive=True))


def leftovers(*, wait_s: float = 30.0) -> list[str]:
    """Live descendants of this process that it did not have at `become_subreaper()`, after waiting up to `wait_s`
    for them to exit (zombies are reaped)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for child in psutil.Process(os.getpid()).children(recursive=True):
            if child.pid in _already_running:
                continue
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    child.wait(timeout=0)
                    continue
                found.append(f"{child.pid}: {' '.join(child.cmdline())[:160]}")
            except (psutil.NoSuchProcess, psutil.TimeoutExpired):
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)  # most are on their way out: every test with a job waits here


def train_command(task_assets: dict, output_dir, *overrides: str) -> list[str]:
    """`slimish train` on the quickstart config, pointed at the session's tiny assets and `output_dir`."""
    import sys

    from tests.conftest import REPO

    return [sys.executable, "-m", "slimish.cli", "train", str(REPO / "configs/quickstart_cpu.yaml"),
            f"model.hf_path={task_assets['model']}", f"data.path={task_assets['train']}", "eval.every=0",
            f"sft.data_path={task_assets['sft']}", f"run.output_dir={output_dir}", *overrides]


def hook_env(run_dir) -> dict:
    """The environment of a job whose hooks are in tests/ (tests.e2e.hooks) and write to `run_dir`."""
    from tests.conftest import REPO

    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "SLIMISH_TEST_RUN_DIR": str(run_dir), "PYTHONPATH": pythonpath}


class Reaper:
    """Reaps this process's zombie children while it runs, as PID 1 reaps orphans. A subreaper (`become_subreaper`)
    inherits the orphans of a job whose driver was killed: its raylet among them. Unreaped, a dead raylet stays a
    zombie whose pid still exists, and Ray's workers and agents, which watch that pid, wait on for it."""

    def __init__(self, interval_s: float = 0.2):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="reaper", daemon=True)

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            try:
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                pass
            self._stop.wait(interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
