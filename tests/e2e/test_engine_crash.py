"""A SGLang engine killed in the middle of a real RL run: the job goes on with the other engine, the requests that
were on the dead one are retried, the engine is restarted, rejoins the weight-sync group and the router at the next
weight sync, and then serves the trained weights (the sync verifies every engine reports the new version, and the
engines' logprobs keep matching the trainer's). Nothing is left running afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.e2e.procs import become_subreaper, leftovers, train_command

pytestmark = pytest.mark.e2e


def read_metrics(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def wait_for(proc, predicate, *, timeout_s: float, log) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-4000:]
        records = predicate()
        if records:
            return records
        time.sleep(1)
    raise AssertionError(f"timed out; driver log:\n{log.read_text()[-4000:]}")


def test_killed_engine_is_restarted_and_rejoins(task_assets, tmp_path):
    become_subreaper()
    cmd = train_command(task_assets, tmp_path, "sft.steps=3", "rl.num_steps=1000", "run.name=crash",
                        "rollout.prompts_per_step=8", "rollout.max_new_tokens=32")
    log = tmp_path / "driver.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=tmp_path)
    metrics = tmp_path / "crash" / "metrics.jsonl"
    try:
        wait_for(proc, lambda: read_metrics(metrics)[1:], timeout_s=900, log=log)  # two steps done
        engine_pid = json.loads((tmp_path / "crash" / "pids.json").read_text())["servers"][1]
        os.killpg(engine_pid, signal.SIGKILL)  # the engine's whole process group: a hard crash
        killed_at = len(read_metrics(metrics))

        def rejoined() -> list[dict]:
            records = read_metrics(metrics)
            back = [i for i, r in enumerate(records) if r["engine_restarts"] >= 1 and r["engines_live"] == 2]
            return records if back and len(records) >= back[0] + 3 else []

        records = wait_for(proc, rejoined, timeout_s=900, log=log)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=180)
    assert not leftovers(), "processes left running after the job"
    assert records[-1]["engine_deaths"] == 1 and records[-1]["engine_restart_failures"] == 0
    down = [r for r in records[killed_at:] if r["engines_live"] == 1]
    assert down, "steps ran on one engine while the other restarted"
    for record in records:
        assert record["logprob_abs_diff_max"] <= 1e-4, record
        assert record["samples_completed"] + record["samples_truncated"] > 0, "every step trained"
    first_back = next(i for i, r in enumerate(records) if r["engines_live"] == 2 and r["engine_restarts"] >= 1)
    assert all(r["engines_live"] == 2 for r in records[first_back:])
    text = log.read_text()
    assert "died" in text and "restarted in" in text
