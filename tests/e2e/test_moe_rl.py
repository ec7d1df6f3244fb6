"""RL with a mixture-of-experts model: a tiny GLM-4.5 (sigmoid router with correction bias, shared expert, first
dense layer, partial rotary) trained at expert parallelism 2 (two Megatron ranks, each holding half the experts),
rolled out by a real SGLang CPU engine. After every weight sync the engine's logprobs must equal the trainer's: the
full export gathered every expert, the router bias and the shared expert under the names SGLang loads."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.e2e.procs import become_subreaper, leftovers, train_command

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def glm4_moe(tmp_path_factory):
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("glm4_moe"), corpus=echo_digit.corpus(), family="glm4_moe")


def test_two_rl_steps_with_expert_parallel_moe(task_assets, glm4_moe, tmp_path):
    become_subreaper()
    cmd = train_command({**task_assets, "model": str(glm4_moe)}, tmp_path, "sft.steps=2", "rl.num_steps=2",
                        "run.name=moe", "parallel.num_trainer_ranks=2", "parallel.expert_parallel=2",
                        "rollout.engine.num_engines=1", "rollout.prompts_per_step=8", "weight_sync.bucket_mb=0.1",
                        "weight_sync.transport=tensor")  # the engine maps each bucket from the trainer's memory
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    records = [json.loads(line) for line in (tmp_path / "moe" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    print("moe rl:", [{k: r[k] for k in ("step", "logprob_abs_diff_max", "ppo_kl", "reward_mean", "sync_mib")}
                      for r in records])
    for record in records:
        assert record["logprob_abs_diff_max"] <= 1e-4, record
        assert record["samples_failed"] == 0
    assert records[0]["ppo_kl"] == 0.0
    assert not leftovers(), "processes left running after the job"
