"""An RL run stopped after step 2 and started again with more steps resumes at step 3 from its checkpoint: no SFT
warm-up, the engines get the checkpoint's weights (logprob parity holds), metrics.jsonl holds steps 1-4 once, and
the partial-rollout buffer saved with the checkpoint (abort mode: the groups finished beyond step 2's batch, and
those aborted with their tokens) is trained after the resume rather than lost. Weights travel by the `disk`
transport here (several safetensors shards per sync, loaded by the engine, then removed).

The same holds in the asynchronous modes (rl.mode): with `async` (syncing every 2 steps) the checkpoint holds the
groups finished and those still generating, which the resumed job takes up first, with the same prompts; with
`one_step_off` a checkpoint holds the next step's batch, generated while its step trained (the last step of a run
has none), so that run resumes from step 1's checkpoint and trains that batch as step 2."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.e2e.procs import become_subreaper, leftovers, train_command

MODES = {
    "sync": ["rollout.partial.mode=abort", "rollout.partial.over_sampling=2"],
    "one_step_off": ["rl.mode=one_step_off"],
    # with checkpoint.async_save too: each step's checkpoint is written while the next one trains (but the last's)
    "async": ["rl.mode=async", "rl.sync_every=2", "rollout.partial.mode=retract", "rollout.partial.over_sampling=2",
              "checkpoint.async_save=true"],
}


@pytest.mark.parametrize("mode", list(MODES))
def test_run_resumes_from_its_last_checkpoint(task_assets, tmp_path, mode, attached):
    """Both jobs attach to one shared engine: the second finds it holding the first's last weights, resets it to the
    checkpoint and syncs the resumed weights into it."""
    become_subreaper()
    common = ["sft.steps=3", "run.name=resume", *attached.overrides(1), "rollout.prompts_per_step=4",
              "checkpoint.save_every=1", "checkpoint.keep_last=2", *MODES[mode], "rollout.max_new_tokens=48",
              "reward.fn=slimish.tasks.echo_digit.contains_reward", "run.save_rollouts=true",
              "weight_sync.transport=disk", "weight_sync.bucket_mb=0.1"]
    first = subprocess.run(train_command(task_assets, tmp_path, *common, "rl.num_steps=2"), capture_output=True,
                           text=True, timeout=1200, cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    run_dir = tmp_path / "resume"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1", "step_2"]
    if "checkpoint.async_save=true" in MODES[mode]:  # step 1's files were written while step 2 trained
        assert "checkpoint of step 1 staged" in first.stdout and "checkpoint of step 2 staged" not in first.stdout
    resume_at = 1 if mode == "one_step_off" else 2
    buffer_file = run_dir / f"checkpoints/step_{resume_at}/rollout_buffer.jsonl"
    buffer = [json.loads(line) for line in buffer_file.read_text().splitlines()]
    assert buffer, f"groups generated (or generating) but not trained at step {resume_at} are in its checkpoint"

    resume = [f"checkpoint.resume={run_dir}/checkpoints/step_1"] if mode == "one_step_off" else []
    second = subprocess.run(train_command(task_assets, tmp_path, *common, "rl.num_steps=4", *resume),
                            capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert "resumed from" in second.stdout and "sft " not in second.stdout
    assert f"step   {resume_at + 1}/4" in second.stdout and f"step   {resume_at}/4" not in second.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["weight_version"] for r in records] == [1, 2, 3, 4]
    synced = [r for r in records if "sync_buckets" in r]
    assert [r["step"] for r in synced] == ([2, 4] if mode == "async" else [1, 2, 3, 4])
    assert [r["engine_weight_version"] for r in records] == ([0, 2, 2, 4] if mode == "async" else [1, 2, 3, 4])
    for record in records:
        assert record["logprob_abs_diff_max"] <= 1e-4, record  # the engines sample from the loaded weights
        assert record["staleness_max"] <= 4, record  # rollout.partial.max_staleness (its default)
    for record in synced:
        assert record["sync_buckets"] > 1 and record["time_verify_s"] >= 0
    if mode == "one_step_off":
        assert all(r["staleness_max"] == 1 for r in records[1:]), "each batch was generated a version behind"
    assert not any((run_dir / "weight_sync").iterdir()), "every sync's shards are removed once loaded"
    trained = {step: {json.loads(line)["group_id"]: json.loads(line)["prompt"]
                      for line in (run_dir / f"rollouts/step_{step}.jsonl").open()} for step in range(1, 5)}
    finished = [g["group_id"] for g in buffer if all(s["status"] in ("completed", "truncated") for s in g["samples"])]
    # Trained first after the resume, a batch of 4 at a time in the buffer's order: in async mode up to 6 (the batch
    # and rollout.partial.over_sampling) can finish between a step's batch and its checkpoint.
    for first in range(0, len(finished), 4):
        assert set(finished[first:first + 4]) <= set(trained[resume_at + 1 + first // 4]), \
            "groups finished before the interruption are trained first after it, in order"
    if mode == "one_step_off":
        assert set(finished) == set(trained[2]), "step 1's checkpoint held exactly step 2's batch"
    after = {gid: prompt for step in range(resume_at + 1, 5) for gid, prompt in trained[step].items()}
    last_buffer = [json.loads(line)["group_id"]
                   for line in (run_dir / "checkpoints/step_4/rollout_buffer.jsonl").read_text().splitlines()]
    for group in buffer:  # each is trained after the resume, with its prompt, or is still in the newest buffer
        assert after.get(group["group_id"], group["samples"][0]["prompt"]) == group["samples"][0]["prompt"]
        assert group["group_id"] in after or group["group_id"] in last_buffer, f"group {group['group_id']} was lost"
    all_trained = [gid for step in trained.values() for gid in step]
    assert len(all_trained) == len(set(all_trained)) == 16, "every group is trained exactly once"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_3", "step_4"]
    state = json.loads((run_dir / "checkpoints" / "step_4" / "driver.json").read_text())
    assert state["step"] == 4 and state["rollout"]["dataset"] != {"epoch": 0, "cursor": 0}
    assert not leftovers(), "processes left running after the job"
