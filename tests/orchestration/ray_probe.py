"""Run a probe script of this directory in a process of its own, where it starts a real local Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def run_probe(script: str, env: dict[str, str] | None = None) -> str:
    """The stdout of tests/orchestration/`script`, which must exit 0 (else the test fails with its output); `env`:
    more variables for it."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **(env or {})}
    result = subprocess.run([sys.executable, str(Path(__file__).with_name(script))], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout
