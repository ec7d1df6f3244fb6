"""An RL job on SGLang engines of two tensor-parallel ranks each (CPU: `slimish.compat.sglang_cpu` gives SGLang what
it needs for that), engine 0 killed between two buckets of a weight sync and restarted by the job.

Every sync broadcasts to groups of 1 + 2 x 2 ranks (each engine rank joins at its engine's rank offset), one group per
pipeline stage of the trainer (pipeline-parallel 2: two senders take turns, `slimish.weight_sync.stages`), and is
verified on every rank of every engine against the checksums the trainer predicts for that rank's shard
(`slimish.weight_sync.checksums`); after every sync the engines' logprobs match the trainer's. The sync engine 0
died in is released on both senders and starts over to engine 1, the job goes on with it, and the restarted engine
(both its ranks) rejoins the groups and the router at the next sync. Syncs on the other transports to a TP2 engine
are in tests/e2e/test_weight_sync_engines.py (its glm4_moe engine); the sharding pin in tests/weight_sync.
~2.5 minutes: two TP2 engines start (~65 s together), one restarts (~32 s), eight steps."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from tests.e2e import hooks
from tests.e2e.procs import become_subreaper, hook_env, leftovers, train_command
from tests.e2e.test_engine_crash import read_metrics, rejoined_after, wait_for

pytestmark = pytest.mark.e2e


def test_an_rl_job_on_tp2_engines_survives_engine_0_killed_mid_sync(task_assets, tmp_path):
    become_subreaper()
    run_dir = tmp_path / "tp2"
    cmd = train_command(task_assets, tmp_path, "sft.steps=3", "rl.num_steps=1000", "run.name=tp2",
                        "rollout.engine.tensor_parallel=2", "parallel.pipeline_parallel=2",
                        "parallel.num_trainer_ranks=2", "rollout.prompts_per_step=8",
                        "rollout.max_new_tokens=8", "weight_sync.bucket_mb=0.1",
                        "weight_sync.after_bucket_hook=tests.e2e.hooks.fault_between_buckets")
    log = tmp_path / "driver.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=tmp_path, env=hook_env(run_dir))
    metrics = run_dir / "metrics.jsonl"
    try:
        wait_for(proc, lambda: read_metrics(metrics)[1:], timeout_s=900, log=log)  # two steps done
        hooks.arm_fault_between_buckets(run_dir, engine=0, signal_name="SIGKILL")
        records = wait_for(proc, rejoined_after(metrics, 1), timeout_s=900, log=log)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=180)
    assert not leftovers(), "processes left running after the job"
    placement = json.loads((run_dir / "placement.json").read_text())
    assert len(placement["engines"]) == 2
    assert records[-1]["engine_deaths"] == 1 and records[-1]["engine_restarts"] == 1
    assert records[-1]["engine_restart_failures"] == 0
    [fault] = hooks.faults_made(run_dir)
    by_step = {r["step"]: r for r in records}
    assert by_step[fault["version"]]["weight_sync_retries"] == 1
    assert by_step[fault["version"] + 1]["engines_live"] == 1, "the next rollout ran on the other engine alone"
    assert records[-1]["engines_live"] == 2
    for record in records:  # every sync verified every rank (a failed verification fails the job)
        assert record["sync_checksums_predicted"] == 1, "checked against the trainer, not engine 0"
        assert record["sync_senders"] == 2
        assert record["logprob_abs_diff_max"] <= 1e-4, record
        assert record["samples_failed"] == 0
    assert log.read_text().count("restarted in") == 1
