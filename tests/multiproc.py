"""Run a script as the ranks of a torch.distributed world on 127.0.0.1, one process per rank.

Each rank gets `--rank R --world-size N --port P` before the caller's arguments. A rank that fails or outlives
`timeout` stops the whole world; the error carries every rank's log tail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import REPO, free_port


def run_world(script: str | Path, *, world_size: int, args: list[str], timeout: float = 300.0,
              env: dict[str, str] | None = None) -> None:
    """`env`: variables set for the ranks on top of this process's environment."""
    port = free_port()
    # One thread per rank: the ranks share the machine's cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    with tempfile.TemporaryDirectory(prefix="world-") as logs:
        log_paths = [Path(logs) / f"rank{rank}.log" for rank in range(world_size)]
        procs = []
        try:
            for rank, log_path in enumerate(log_paths):
                with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
                    cmd = [sys.executable, str(script), "--rank", str(rank), "--world-size", str(world_size),
                           "--port", str(port), *args]
                    procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO))
            codes = [proc.wait(timeout=timeout) for proc in procs]
        except subprocess.TimeoutExpired:
            codes = None
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if codes is None or any(codes):
            tails = "\n".join(f"--- rank {rank} ---\n{path.read_text(errors='replace')[-3000:]}"
                              for rank, path in enumerate(log_paths))
            raise AssertionError(f"{Path(script).name} failed (exit codes {codes}):\n{tails}")
