"""SGLang engines of two tensor-parallel ranks each killed in a real RL run, twice, in one job (sharing its
start-up): engine 1 in the middle of a rollout, then engine 1 hung in the middle of a weight sync, between two
buckets. (An engine SIGKILLed between two buckets: one node part of an engine spanning two nodes, in the Slurm tier's
tests/slurm/test_sbatch.py.) Each time the job goes on with the other engine: the requests
that were on the dead one are retried, the interrupted sync starts over to the survivor, the engine is restarted,
rejoins the weight-sync group and the router at the next weight sync, and then serves the trained weights (every
sync verifies every engine's parameters, and the engines' logprobs keep matching the trainer's). No sample is lost.
Then the job, mid-run, gets SIGTERM: it finishes its step, saves a checkpoint of it (`checkpoint.save_on_signal`),
stops engines, router, actors and Ray, exits 75 (the code launch/train.sbatch requeues on), and leaves nothing
running (an interrupt test until 2026-11-26, which started a job of its own for it).

Where each fault lands is deterministic. Mid-rollout: the engine is paused in place (its requests freeze, so none
can finish and the rollout cannot end) and killed only once it holds requests; otherwise it is resumed and asked
again. Mid-sync: the `weight_sync.after_bucket_hook` of tests/e2e/hooks.py sends the signal the test armed right
after bucket 1 of a sync is on its way: SIGSTOP to engine 1 (restarted by then): alive but hung, with the sync
waiting on it, until the watchdog finds its processes stopped (state T in /proc) at two
checks and kills it, seconds later, without asking it anything (the hang probe's 60 s bound is not waited out); the
sync then starts over to engine 0 and engine 1 is restarted as after its kill. The driver, watching the engine set
while the sync runs, releases the senders as soon as the engine is lost; each faulted sync's time_sync_stalled_s
(how long the fault held it) is printed.

The trainer runs at pipeline-parallel 2, so every sync has two senders (`slimish.weight_sync.owners`): on gloo
`weight_sync.sharded` auto takes the sharded broadcast, and stage 1's leader sends its own stage over per-rank
groups of its own while rank 0 posts every request; the sync interrupted between two buckets is released on both
of them, and rebuilt with new groups for both. Over NCCL auto keeps the full path, where stage senders send the
whole stage (`slimish.weight_sync.stages`): that route ran this test until 2026-11-29 and is covered by
tests/e2e/test_rl_loop.py's pipeline-parallel job and tests/e2e/test_weight_sync_engines.py's failing stages. A
job-level kill on the one-sender sharded broadcast is asserted in tests/slurm/test_sbatch.py's spanning job, freezes
and kills mid-sync per transport in tests/e2e/test_sync_faults.py.

The engines run at tensor-parallel 2 (on CPU: `slimish.compat.sglang_cpu`'s settings for it): every sync broadcasts
to groups of 1 + 2 x 2 ranks (each engine rank at its engine's rank offset) and is verified on every rank of every
engine against the checksums the trainer predicts for that rank's shard (`sync_checksums_predicted`); a kill or a
freeze takes both ranks of an engine, and a restart brings both back. The watchdog and restart code is the same for
engines of one rank. Syncs on the other transports to a TP2 engine are in tests/e2e/test_weight_sync_engines.py.

While an engine is down the job is paced (`tests.e2e.hooks.pace_while_restarting`: each rollout starts 4 s late), so
that the restart gets the cores it would have on a node of its own: on this 2-core machine a job at full speed made
each restart take 110-120 s instead of ~70 s, and the test 478 s instead of 355 s (same machine, back to back)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from slimish.engines.client import EngineAuth
from tests.e2e import hooks
from tests.e2e.procs import become_subreaper, hook_env, leftovers, train_command


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


def kill_while_generating(url: str, engine_pid: int, *, api_key, timeout_s: float) -> int:
    """SIGKILL the engine's process group at a moment it holds rollout requests; returns how many it held. Two at
    least: a lone one may be the watchdog's /health_generate probe, which an idle engine queues like any request and
    whose loss fails no rollout request (the test asks for retried ones). It is paused in place (so that what it
    holds stays held until the kill) only once it was seen generating, and for one /v1/loads call: an engine kept
    paused would fail the watchdog's /health_generate probe, a hang this test does not mean to cause here."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=30, auth=EngineAuth(api_key)) as http:
        while time.monotonic() < deadline:
            if hooks.engine_requests(http, url, waiting=True) >= 2:
                http.post("/pause_generation", json={"mode": "in_place"}).raise_for_status()
                held = hooks.engine_requests(http, url, waiting=True)
                if held >= 2:
                    os.killpg(engine_pid, signal.SIGKILL)  # the engine's whole process group: a hard crash
                    return held
                http.post("/continue_generation", json={}).raise_for_status()
            time.sleep(0.05)
    raise AssertionError(f"{url} never held two requests in {timeout_s} s")


def rejoined_after(metrics, restarts: int):
    """A predicate: the records, once `restarts` restarts are done, both engines are live and 3 more steps ran."""
    def predicate() -> list[dict]:
        records = read_metrics(metrics)
        back = [i for i, r in enumerate(records) if r["engine_restarts"] >= restarts and r["engines_live"] == 2]
        return records if back and len(records) >= back[0] + 3 else []
    return predicate


def test_killed_engines_are_restarted_and_rejoin(task_assets, tmp_path):
    become_subreaper()
    run_dir = tmp_path / "crash"
    # Small buckets: a sync spans several (the quickstart model is 0.44 MiB), so there is a "between two buckets".
    # Hang probes every 5 s, hung after the default 60 s without an answer (fault 2's frozen engine is found sooner,
    # by its stopped processes). A probe that lands just after fault 1's kill finds the port refusing; the watchdog
    # counts that as the death it is, not a hang.
    cmd = train_command(task_assets, tmp_path, "sft.steps=3", "rl.num_steps=1000", "run.name=crash",
                        "parallel.pipeline_parallel=2", "parallel.num_trainer_ranks=2",
                        "rollout.engine.tensor_parallel=2",
                        "rollout.engine.health_interval_s=5", "rollout.engine.hang_timeout_s=60",
                        "rollout.prompts_per_step=8", "rollout.max_new_tokens=32", "weight_sync.bucket_mb=0.1",
                        "weight_sync.after_bucket_hook=tests.e2e.hooks.fault_between_buckets",
                        "run.phase_hook=tests.e2e.hooks.pace_while_restarting")
    log = tmp_path / "driver.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=tmp_path, env=hook_env(run_dir))
    metrics = run_dir / "metrics.jsonl"
    try:
        wait_for(proc, lambda: read_metrics(metrics)[1:], timeout_s=900, log=log)  # two steps done
        # 1. Engine 1, mid-rollout.
        engine_pid = json.loads((run_dir / "pids.json").read_text())["servers"][1]
        engine_url = json.loads((run_dir / "placement.json").read_text())["engines"][1]["url"]
        held = kill_while_generating(engine_url, engine_pid, api_key=hooks.job_keys(run_dir), timeout_s=300)
        killed_at = len(read_metrics(metrics))
        wait_for(proc, rejoined_after(metrics, 1), timeout_s=900, log=log)
        # 2. Engine 1 (its restarted server) frozen between two buckets of the next sync.
        hooks.arm_fault_between_buckets(run_dir, engine=1, signal_name="SIGSTOP")
        records = wait_for(proc, rejoined_after(metrics, 2), timeout_s=900, log=log)
        # 3. SIGTERM mid-run (the job is set for 1000 steps): the driver finishes the step, saves it, stops
        # engines, router, actors and Ray, and exits 75 (requeue), leaving nothing.
        servers = json.loads((run_dir / "pids.json").read_text())["servers"]
    finally:
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(timeout=400)
    text = log.read_text()
    assert exit_code == 75, text[-3000:]
    stopped = re.search(r"stopped by SIGTERM after step (\d+); saved checkpoint (\S+):", text)
    assert stopped, text[-3000:]
    assert Path(stopped[2]).name == f"step_{stopped[1]}" and (Path(stopped[2]) / "driver.json").is_file()
    assert int(stopped[1]) >= len(records)
    assert not leftovers(), "processes left running after SIGTERM"
    for pid in servers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert records[-1]["engine_deaths"] == 2 and records[-1]["engine_restart_failures"] == 0
    assert records[-1]["engine_hangs"] == 1
    retried = sum(r.get("requests_retried", 0) for r in records)
    assert held > 0 and retried > 0, "the requests the killed engine held were retried"
    assert sum(r.get("samples_failed", 0) for r in records) == 0, "no sample was lost"
    down = [r for r in records[killed_at:] if r["engines_live"] == 1]
    assert down, "steps ran on one engine while the other restarted"
    for record in records:
        assert record["logprob_abs_diff_max"] <= 1e-4, record
        assert record["sync_checksums_predicted"] == 1, "every rank checked against the trainer, not engine 0"
        # The sharded route from several senders (gloo: 'auto' shards broadcast): stage 1's leader sends its own
        # stage over per-rank groups of its own while rank 0 posts every request.
        assert record["sync_sharded"] == 1 and record["sync_senders"] == 2, record
        assert record["samples_completed"] + record["samples_truncated"] > 0, "every step trained"
    # Each sync an engine died or hung in was done again, to the other engine, within the same step.
    faults = hooks.faults_made(run_dir)
    assert [(f["engine"], f["signal"]) for f in faults] == [(1, "SIGSTOP")]
    by_step = {r["step"]: r for r in records}
    stalls = {fault["signal"]: by_step[fault["version"]]["time_sync_stalled_s"] for fault in faults}
    print(f"\ntime_sync_stalled_s of the faulted syncs: {stalls}")
    for fault in faults:
        assert by_step[fault["version"]]["weight_sync_retries"] == 1, fault
        # Held no longer than the bucket's deadline (weight_sync.bucket_timeout_s, 60 s, plus 0.1 MiB at 32 MiB/s)
        assert 0 <= by_step[fault["version"]]["time_sync_stalled_s"] < 61, fault
        assert by_step[fault["version"] + 1]["engines_live"] == 1, "the next rollout ran on the other engine alone"
    assert sum(r["weight_sync_retries"] for r in records) == 1
    first_back = next(i for i, r in enumerate(records) if r["engines_live"] == 2 and r["engine_restarts"] >= 2)
    assert all(r["engines_live"] == 2 for r in records[first_back:])
    text = log.read_text()
    assert text.count("during the weight sync") == 1 and "is frozen: its process(es)" in text
    assert text.count("restarted in") == 2
