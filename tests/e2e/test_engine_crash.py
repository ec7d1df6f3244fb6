"""A SGLang engine killed in the middle of a real RL run: the job goes on with the other engine, the requests that
were on the dead one are retried, the engine is restarted, rejoins the weight-sync group and the router at the next
weight sync, and then serves the trained weights (the sync verifies every engine reports the new version, and the
engines' logprobs keep matching the trainer's). No sample is lost. Nothing is left running afterwards.

Where the kill lands is made deterministic: the engine is paused in place (its requests freeze, so none can finish
and the rollout cannot end) and killed only once it holds requests; otherwise it is resumed and asked again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
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


def _requests_on(load: dict | list) -> int:
    """Running + waiting requests in a /v1/loads answer (summed over its data-parallel ranks)."""
    if isinstance(load, list):
        return sum(_requests_on(item) for item in load)
    if not isinstance(load, dict):
        return 0
    return sum(value if key in ("num_running_reqs", "num_waiting_reqs") and isinstance(value, int)
               else _requests_on(value) for key, value in load.items())


def kill_while_generating(url: str, engine_pid: int, *, timeout_s: float) -> int:
    """SIGKILL the engine's process group at a moment it holds requests; returns how many it held."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=30) as http:
        while time.monotonic() < deadline:
            http.post("/pause_generation", json={"mode": "in_place"}).raise_for_status()
            held = _requests_on(http.get("/v1/loads").json()["loads"])
            if held:
                os.killpg(engine_pid, signal.SIGKILL)  # the engine's whole process group: a hard crash
                return held
            http.post("/continue_generation", json={}).raise_for_status()
            time.sleep(0.05)
    raise AssertionError(f"{url} held no request for {timeout_s} s")


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
        engine_url = json.loads((tmp_path / "crash" / "placement.json").read_text())["engines"][1]["url"]
        held = kill_while_generating(engine_url, engine_pid, timeout_s=300)
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
    retried = sum(r.get("requests_retried", 0) for r in records)
    assert held > 0 and retried > 0, "the requests the killed engine held were retried"
    assert sum(r.get("samples_failed", 0) for r in records) == 0, "no sample was lost"
    down = [r for r in records[killed_at:] if r["engines_live"] == 1]
    assert down, "steps ran on one engine while the other restarted"
    for record in records:
        assert record["logprob_abs_diff_max"] <= 1e-4, record
        assert record["samples_completed"] + record["samples_truncated"] > 0, "every step trained"
    first_back = next(i for i, r in enumerate(records) if r["engines_live"] == 2 and r["engine_restarts"] >= 1)
    assert all(r["engines_live"] == 2 for r in records[first_back:])
    text = log.read_text()
    assert "died" in text and "restarted in" in text
