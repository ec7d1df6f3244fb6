"""A colocated RL job (placement.colocate) on CPU: one trainer rank and one SGLang engine in one placement bundle,
taking turns (`slimish.orchestration.colocation`), with the `tensor` transport. The engine's memory release is real
SGLang (/release_memory_occupation and back; on the CPU it frees nothing), the trainer's offload finds nothing on a
device to move (the moves themselves: the emulated-GPU tier and tests/gpu).

Shown: the driver's phases in the colocated order at the warm-up, at every step and around every checkpoint; each
logged; logprob parity after every full sync (verified by checksums, as every sync); the colocated metrics; the
placement; and a second job resuming from the checkpoint of step 3, taken while the trainer was offloaded, through
the same turns, at another layout: two trainer ranks (two data-parallel replicas) and two engines, where each
replica's rank sends the weights to the engine on its own GPU only (verified there by checksums)."""

from __future__ import annotations

import json
import subprocess

from tests.e2e.hooks import phases_recorded
from tests.e2e.procs import become_subreaper, hook_env, leftovers, train_command

TRAINER_TURN = ["release", "onload"]
ENGINES_TURN = ["offload_state", "resume_weights", "full_sync", "offload_params", "resume_kv_cache"]
STEP = ["rollout", *TRAINER_TURN, "train", "sync", *ENGINES_TURN]
SAVE = ["release_kv_cache", "resume_kv_cache"]


def test_a_colocated_job_takes_turns_every_step_and_resumes(task_assets, tmp_path):
    become_subreaper()
    run_dir = tmp_path / "colocated"
    common = ["run.name=colocated", "placement.colocate=true", "weight_sync.transport=tensor",
              "rollout.engine.num_engines=1", "weight_sync.bucket_mb=0.1", "rollout.prompts_per_step=4",
              "sft.steps=2", "checkpoint.save_every=2", "run.phase_hook=tests.e2e.hooks.record_phases"]
    first = subprocess.run(train_command(task_assets, tmp_path, *common, "rl.num_steps=3"), capture_output=True,
                           text=True, timeout=1200, cwd=tmp_path, env=hook_env(run_dir))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    # Start: the built trainer offloads before the engine starts; the warm-up (step 0) trains in the trainer's turn
    # and ends in the engines' turn; checkpoints after steps 2 and 3.
    expected = [("offload", 0)] + [(p, 0) for p in TRAINER_TURN + ENGINES_TURN]
    for step in (1, 2, 3):
        expected += [(p, step) for p in STEP] + ([(p, step) for p in SAVE] if step >= 2 else [])
    assert phases_recorded(run_dir) == expected
    logged = [line.split("colocated step ", 1)[1].split(" in ")[0] for line in first.stderr.splitlines()
              if "colocated step " in line]
    assert logged == [f"{step}: {phase}" for phase, step in expected if phase not in ("rollout", "train", "sync")]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["logprob_abs_diff_max"] <= 1e-4, record
        assert record["sync_buckets"] > 1 and record["engine_weight_version"] == record["step"]
        assert record["offload_bytes"] == 0, "on the CPU the trainer has nothing on a device"
        assert all(record[key] >= 0 for key in ("time_release_s", "time_onload_s", "time_offload_s",
                                                "time_resume_s", "time_colocated_sync_s"))
        assert record["engine_deaths"] == 0 and record["samples_failed"] == 0
        assert record["sync_engines"] == 1
    assert records[0]["ppo_kl"] == 0.0
    placement = json.loads((run_dir / "placement.json").read_text())
    assert [t["gpus"] for t in placement["trainer"]] == [0.0] and len(placement["engines"]) == 1
    assert not leftovers(), "processes left running after the job"

    (run_dir / "phases.jsonl").unlink()
    wider = ["parallel.num_trainer_ranks=2", "rollout.engine.num_engines=2", "rl.num_steps=4"]
    second = subprocess.run(train_command(task_assets, tmp_path, *common, *wider), capture_output=True,
                            text=True, timeout=1200, cwd=tmp_path, env=hook_env(run_dir))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert "resumed from" in second.stdout and "step   4/4" in second.stdout
    # The checkpoint of step 3 is loaded in the trainer's turn, its weights go to the engine in the engines' turn
    # (both labelled step 3); no warm-up.
    assert phases_recorded(run_dir) == ([("offload", 0)] + [(p, 3) for p in TRAINER_TURN + ENGINES_TURN]
                                        + [(p, 4) for p in STEP + SAVE])
    resumed = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert resumed["step"] == 4 and resumed["logprob_abs_diff_max"] <= 1e-4
    assert resumed["sync_engines"] == 1, "rank 0 sent to the engine on its GPU; rank 1 to the other"
    placement = json.loads((run_dir / "placement.json").read_text())
    assert [t["rank"] for t in placement["trainer"]] == [0, 1] and len(placement["engines"]) == 2
    assert not leftovers(), "processes left running after the job"
