"""An RL run stopped after step 2 and started again with more steps resumes at step 3 from its checkpoint: no SFT
warm-up, the engines get the checkpoint's weights (logprob parity holds), metrics.jsonl holds steps 1-4 once."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.e2e.procs import become_subreaper, leftovers, train_command

pytestmark = pytest.mark.e2e


def test_run_resumes_from_its_last_checkpoint(task_assets, tmp_path):
    become_subreaper()
    common = ["sft.steps=3", "run.name=resume", "rollout.engine.num_engines=1", "rollout.prompts_per_step=4",
              "checkpoint.save_every=1", "checkpoint.keep_last=2"]
    first = subprocess.run(train_command(task_assets, tmp_path, *common, "rl.num_steps=2"), capture_output=True,
                           text=True, timeout=1200, cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    run_dir = tmp_path / "resume"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1", "step_2"]

    second = subprocess.run(train_command(task_assets, tmp_path, *common, "rl.num_steps=4"), capture_output=True,
                            text=True, timeout=1200, cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert "resumed from" in second.stdout and "sft " not in second.stdout
    assert "step   3/4" in second.stdout and "step   1/4" not in second.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["weight_version"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert record["logprob_abs_diff_max"] <= 1e-4, record  # the engines sample from the loaded weights
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_3", "step_4"]
    state = json.loads((run_dir / "checkpoints" / "step_4" / "driver.json").read_text())
    assert state["step"] == 4 and state["rollout"]["dataset"] != {"epoch": 0, "cursor": 0}
    assert not leftovers(), "processes left running after the job"
