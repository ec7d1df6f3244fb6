"""A job started from a torch_dist checkpoint (model.megatron_path) through the driver: the trainer starts from it,
the engines get its weights before the first rollout (they booted from model.hf_path's), and the start-up's read
figures reach the log and the first step's metrics."""

from __future__ import annotations

import json
import subprocess

from tests.e2e.procs import become_subreaper, hook_env, leftovers, train_command


def test_a_job_starts_from_a_converted_checkpoint_of_other_weights(task_assets, tmp_path, attached):
    """The converted checkpoint holds other weights than model.hf_path (the tiny model drawn with another seed), and
    no SFT warm-up syncs anything: the first step's engine and trainer logprobs agree within fp32 noise only if the
    driver sent the trainer's weights before the rollout. Attached to the session's shared engines: one 1-step
    job (about 60 s here)."""
    from slimish.megatron_bridge.convert import hf_to_megatron
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    become_subreaper()
    other = build_tiny_model(tmp_path / "other", corpus=echo_digit.corpus(), seed=1)
    converted = hf_to_megatron(hf_dir=other, out_dir=tmp_path / "converted", progress=False)
    cmd = train_command(task_assets, tmp_path, "sft.steps=0", "rl.num_steps=1", "run.name=megatron",
                        "rollout.prompts_per_step=8", f"model.megatron_path={converted}", *attached.overrides())
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=tmp_path,
                            env=hook_env(tmp_path / "megatron"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert f"trainer ranks read their initial weights from {converted}" in result.stdout
    (record,) = [json.loads(line) for line in (tmp_path / "megatron" / "metrics.jsonl").read_text().splitlines()]
    assert record["logprob_abs_diff_max"] <= 1e-4, record
    assert record["startup_weights_rchar_max"] > 0 and record["startup_weights_requested_max"] == 0
    assert not leftovers(), "processes left running after the job"
