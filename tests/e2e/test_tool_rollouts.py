"""Multi-turn tool use end to end: the calculator task (slimish/tasks/calculator.py) on real engines, its rollout
program inserting the calculator's answers between the model's turns, in partial-rollout abort mode (so requests are
interrupted at the end of steps and their programs called again).

Asserts that the reward rises, by 0.2 over the last 3 steps against the first 3 (the warmed-up model copies the
calculator's answer right but calls it in only ~30% of transcripts, so it starts near 0.3; by step 10 it is near its
plateau: last-3 means 0.857 and 0.883 against first-3 means 0.310 and 0.341 in two runs on 2026-11-27; runs of 20
steps, the test's length until then, ended at 0.90, 0.81, 0.90 and 0.84); that no environment token is trained on
(every span the calculator inserted has loss_mask 0 and logprob 0, every other token loss_mask 1); and that every
trained token id and logprob came from the engine: the trainer recomputes the logprob of every trained token under
the weights the engine sampled with, and they match the engine's to 1e-4 at every step (an inserted or re-tokenised
token would not).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.e2e.procs import become_subreaper, leftovers

STEPS = 10


@pytest.fixture(scope="module")
def calculator_assets(tmp_path_factory) -> dict[str, str]:
    from slimish.tasks import calculator
    from slimish.tasks.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("calc")
    model = build_tiny_model(root / "model", corpus=calculator.corpus(), family="qwen3")
    return {"model": str(model), **calculator.write_datasets(root)}


def test_the_calculator_is_learned_and_its_tokens_never_train(calculator_assets, tmp_path):
    become_subreaper()
    a = calculator_assets
    cmd = [sys.executable, "-m", "slimish.cli", "train", "--config", str(REPO / "configs/calculator_cpu.yaml"),
           f"model.hf_path={a['model']}", f"data.path={a['train']}", f"sft.data_path={a['sft']}",
           f"eval.data_path={a['eval']}", f"run.output_dir={tmp_path}", "run.name=calc", f"rl.num_steps={STEPS}",
           "eval.every=5", "run.save_rollouts=true", "rollout.partial.mode=abort", "rollout.partial.over_sampling=4"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    run_dir = tmp_path / "calc"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in records]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"calculator reward: first-3 mean {first:.3f}, last-3 mean {last:.3f}; per step {rewards}")
    assert last >= first + 0.2, rewards
    assert all(r["logprob_abs_diff_max"] <= 1e-4 for r in records), [r["logprob_abs_diff_max"] for r in records]
    assert all(r["samples_failed"] == 0 and r["reward_failures"] == 0 for r in records)
    assert {"eval/held_out/pass@1", "eval/held_out/pass@4"} <= set(records[-1])

    tool_uses = continued = 0
    for step in range(1, STEPS + 1):
        for line in (run_dir / "rollouts" / f"step_{step}.jsonl").open():
            sample = json.loads(line)
            spans = sample["meta"].get("environment_spans", [])
            env = {i for start, end in spans for i in range(start, end)}
            assert sample["loss_mask"] == [0 if i in env else 1 for i in range(len(sample["response_ids"]))]
            assert all(sample["rollout_logprobs"][i] == 0.0 for i in env)
            tool_uses += bool(spans)
            continued += sample["meta"]["segments"] > len(spans) + 1  # more requests than turns: interrupted
    print(f"samples that called the calculator: {tool_uses}; interrupted and continued: {continued}")
    assert tool_uses > 0
    assert not leftovers(), "processes left running after the job"


PPO_STEPS = 3


def test_ppo_trains_on_multi_turn_responses_with_the_calculator(calculator_assets, tmp_path):
    """PPO (critic, GAE over the model's own tokens) on transcripts the calculator's answers interrupt: every step
    completes with a finite, trained critic; the trained samples include tool calls, so GAE crossed environment spans
    (whose hand-computed cases are in tests/trainer/test_estimators.py)."""
    import math

    become_subreaper()
    a = calculator_assets
    cmd = [sys.executable, "-m", "slimish.cli", "train", "--config", str(REPO / "configs/calculator_cpu.yaml"),
           f"model.hf_path={a['model']}", f"data.path={a['train']}", f"sft.data_path={a['sft']}",
           f"run.output_dir={tmp_path}", "run.name=calc_ppo", f"rl.num_steps={PPO_STEPS}", "eval.every=0",
           "run.save_rollouts=true", "rollout.engine.num_engines=1", "trainer.loss.advantage_estimator=ppo",
           "trainer.loss.reward_kl_coef=0.01", "trainer.critic.lr=0.001"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    run_dir = tmp_path / "calc_ppo"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, PPO_STEPS + 1))
    assert all(math.isfinite(r["value_loss"]) and r["critic_grad_norm"] > 0 for r in records), records
    assert all(r["samples_failed"] == 0 and r["logprob_abs_diff_max"] <= 1e-4 for r in records)
    samples = [json.loads(line) for step in range(1, PPO_STEPS + 1)
               for line in (run_dir / "rollouts" / f"step_{step}.jsonl").open()]
    with_tool = [s for s in samples if s["meta"].get("environment_spans")]
    print(f"ppo on the calculator: value_loss {[round(r['value_loss'], 4) for r in records]}, "
          f"{len(with_tool)} of {len(samples)} samples called the calculator")
    assert with_tool and all(math.isfinite(s["advantage"]) for s in samples)
    assert not leftovers(), "processes left running after the job"
