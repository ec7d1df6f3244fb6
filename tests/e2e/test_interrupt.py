"""SIGTERM in the middle of a run: the driver stops engines, router, actors and Ray, and exits 143 (128 + SIGTERM)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.e2e.procs import become_subreaper, leftovers, train_command

pytestmark = pytest.mark.e2e


def test_sigterm_mid_run_leaves_nothing(task_assets, tmp_path):
    become_subreaper()
    cmd = train_command(task_assets, tmp_path, "sft.steps=0", "rl.num_steps=1000", "run.name=interrupted",
                        "rollout.engine.num_engines=1", "rollout.prompts_per_step=4")
    log = (tmp_path / "driver.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    metrics = tmp_path / "interrupted" / "metrics.jsonl"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and metrics.read_text().strip():
            break
        time.sleep(1)
    assert proc.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
    pids = json.loads((tmp_path / "interrupted" / "pids.json").read_text())["servers"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=180) == 128 + signal.SIGTERM, (tmp_path / "driver.log").read_text()[-3000:]
    assert "stopped by signal 15" in (tmp_path / "driver.log").read_text()
    assert not leftovers(), "processes left running after SIGTERM"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
