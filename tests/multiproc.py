"""Run a script as the ranks of a torch.distributed world on 127.0.0.1, one process per rank.

Each rank gets `--rank R --world-size N --port P` before the caller's arguments. A rank that fails or outlives
`timeout` stops the whole world; the error carries every rank's log tail.

On a machine without CUDA the ranks are forked from a warm process (one per distinct `env`, kept for the session)
that has already imported torch, Megatron-Core, transformers and the trainer: a fresh interpreter spends ~8 s of CPU
on those imports, more than most of these worlds spend on their work, and the fast tier starts worlds ~100 times.
The warm process does nothing else before it forks (no thread, no process group, no tensor maths), so a rank starts
as a fresh interpreter would after the same imports: the script runs as `__main__` in the repository with its own
argv, log and process group, and ends as an interpreter does (exit handlers run; what it leaves is killed).
With CUDA the ranks are fresh interpreters (`subprocess`), since a process that has asked about CUDA must not fork.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.conftest import REPO, free_port

# What the warm process imports before it forks ranks (`megatron_cpu.apply()` first: it must precede Megatron's
# import, and reads SLIMISH_EMULATED_GPU, one reason for one warm process per environment).
PRELOAD = """
from slimish.compat import megatron_cpu
megatron_cpu.apply()
import megatron.core.dist_checkpointing
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
import slimish.megatron_bridge.bridge, slimish.megatron_bridge.full_export, slimish.trainer.worker
"""
REPLY_MARGIN_S = 120.0  # the warm process enforces `timeout` itself; this bounds waiting for its answer on top


def run_world(script: str | Path, *, world_size: int, args: list[str], timeout: float = 300.0,
              env: dict[str, str] | None = None) -> None:
    """`env`: variables set for the ranks on top of this process's environment."""
    port = free_port()
    # One thread per rank: the ranks share the machine's cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    env.pop("PYTEST_CURRENT_TEST", None)  # pytest's per-test variable: it would make every world's warm process new
    with tempfile.TemporaryDirectory(prefix="world-") as logs:
        log_paths = [Path(logs) / f"rank{rank}.log" for rank in range(world_size)]
        argvs = [[str(script), "--rank", str(rank), "--world-size", str(world_size), "--port", str(port), *args]
                 for rank in range(world_size)]
        if _cuda_available():
            codes = _run_fresh(argvs, log_paths, env=env, timeout=timeout)
        else:
            codes = _warm_process(env).run(argvs, log_paths, timeout=timeout)
        if codes is None or any(codes):
            tails = "\n".join(f"--- rank {rank} ---\n{path.read_text(errors='replace')[-3000:]}"
                              for rank, path in enumerate(log_paths) if path.exists())
            raise AssertionError(f"{Path(script).name} failed (exit codes {codes}):\n{tails}")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _run_fresh(argvs: list[list[str]], log_paths: list[Path], *, env: dict[str, str], timeout: float
               ) -> list[int] | None:
    """Each rank a fresh interpreter; exit codes, None when one outlived `timeout` (all are then killed)."""
    procs = []
    try:
        for argv, log_path in zip(argvs, log_paths):
            with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
                procs.append(subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                                              env=env, cwd=REPO))
        return [proc.wait(timeout=timeout) for proc in procs]
    except subprocess.TimeoutExpired:
        return None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class _WarmProcess:
    """A `python -m tests.multiproc` process with PRELOAD imported, answering one world at a time (stdin/stdout
    JSON lines); it exits when its stdin closes (this process ended or `close()`), its ranks when it dies."""

    def __init__(self, env: dict[str, str]):
        self.lock = threading.Lock()
        self.log = tempfile.NamedTemporaryFile(prefix="warm-ranks-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.multiproc"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env, cwd=REPO, text=True)

    def run(self, argvs: list[list[str]], log_paths: list[Path], *, timeout: float) -> list[int] | None:
        request = {"argvs": argvs, "logs": [str(path) for path in log_paths], "timeout": timeout}
        with self.lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout + REPLY_MARGIN_S)
            line = self.proc.stdout.readline() if ready else ""
        if not line:
            log = Path(self.log.name).read_text(errors="replace")[-3000:]
            self.close()
            raise AssertionError(f"the warm rank process gave no answer (exit code {self.proc.poll()}):\n{log}")
        return json.loads(line)["codes"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)


_WARM: dict[tuple, _WarmProcess] = {}
_WARM_LOCK = threading.Lock()


def _warm_process(env: dict[str, str]) -> _WarmProcess:
    key = tuple(sorted(env.items()))
    with _WARM_LOCK:
        warm = _WARM.get(key)
        if warm is None or warm.proc.poll() is not None:
            warm = _WARM[key] = _WarmProcess(env)
        return warm


@atexit.register
def _close_warm_processes() -> None:
    for warm in _WARM.values():
        warm.close()


# ------------------------------------------------------------------------------------ the warm process itself
def _die_with_parent() -> None:
    """SIGKILL this process when its parent's thread that forked it ends (Linux's PR_SET_PDEATHSIG): for a rank,
    whose parent is the single-threaded warm process. (Not for the warm process itself: a test thread may start it,
    and ends long before the session; it ends when its stdin closes or its parent is gone, see `_world`.)"""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def _rank(argv: list[str], log_path: str) -> None:
    """In a forked child: run argv[0] as __main__ with argv, its output to `log_path`; never returns."""
    import logging
    import runpy
    import traceback

    code = 1
    try:
        os.setpgid(0, 0)  # the rank's own process group: what it leaves behind is killed with it (`_world`)
        _die_with_parent()
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        # An interpreter's exit: its atexit handlers end what the rank started (multiprocessing's finalizers stop
        # the manager process Megatron's checkpoint writer spawns; skipped, one leaked per save).
        try:
            atexit._run_exitfuncs()
        finally:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _world(argvs: list[list[str]], logs: list[str], timeout: float) -> list[int] | None:
    """Fork one rank per argv; their exit codes, or None when one outlived `timeout` (all are then killed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for argv, log_path in zip(argvs, logs):
        pid = os.fork()
        if pid == 0:
            _rank(argv, log_path)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    parent = os.getppid()
    while len(codes) < len(pids) and time.monotonic() < deadline and os.getppid() == parent:
        for pid in pids:
            # Seen exited but not reaped: its pid, its group's id, stays taken until the group is killed below.
            if pid not in codes and os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                codes[pid] = _end_rank(pid)
        time.sleep(0.05)
    if len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                os.kill(pid, signal.SIGKILL)
                _end_rank(pid)
        return None
    return [codes[pid] for pid in pids]


def _end_rank(pid: int) -> int:
    """Kill whatever is left in a rank's process group, reap the rank; its exit code."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _serve() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the imports or a rank's start print goes to the log, not into the replies
    parent = os.getppid()
    exec(PRELOAD, {})
    for line in sys.stdin:
        request = json.loads(line)
        codes = _world(request["argvs"], request["logs"], request["timeout"])
        if os.getppid() != parent:  # the tests are gone: so are its ranks (killed by `_world`), and so is this
            return
        replies.write(json.dumps({"codes": codes}) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve()
