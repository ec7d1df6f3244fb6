"""TrainerGroup.call_all puts its arguments in Ray's object store once, whatever the number of ranks (a real local
Ray, in a process of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_a_call_to_every_rank_pickles_its_arguments_once():
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("call_all_probe.py"))], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "results=[('Payload', 7), ('Payload', 7), ('Payload', 7)] pickled=1" in result.stdout, result.stdout
