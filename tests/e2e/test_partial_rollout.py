"""Partial rollouts with the real stack (2 SGLang CPU engines, router, Ray, Megatron, gloo weight sync).

abort: the job over-samples; at the end of each step the requests still running are aborted on the engines, kept
with their tokens, and continued in a later step from prompt + partial response, across a weight sync. It also runs
with dynamic sampling: groups without reward variance are replaced, so every group a step trains has it.
retract: generation runs on while the trainer trains; each weight sync pauses the engines in retract mode and the
requests continue with the new weights, so single responses mix two weight versions. That a sync finds requests
running is made certain by a phase hook (this tiny model trains a step in ~0.1 s: left alone, the engines finish
the next step's groups first, or not, as it happens).

In both, the engines' logprobs of the tokens sampled with the trainer's current weights match the trainer's (the
continuation conditions on the right context), while the tokens tagged with older versions differ (the tags are
true), and no process is left behind. The model is untrained (no SFT warm-up), so the policy changes at every step.
Left alone, its responses nearly all run to rollout.max_new_tokens, and groups that start together finish together
(then no request is running when a batch is complete, and nothing is aborted). The abort test therefore stops each
response at the first "e" or "t" (roughly one character in 18 is one of them): lengths are near geometric, groups
finish at spread times, and the reward of a response is whether it is long (`tests.e2e.hooks.long_response_reward`),
which splits nearly every group, so that dynamic sampling seldom drops a continued group.
"""

from __future__ import annotations

import json
import subprocess

from tests.e2e.procs import become_subreaper, hook_env, leftovers, train_command

COMMON = ("sft.steps=0", "reward.fn=slimish.tasks.echo_digit.contains_reward", "rollout.max_new_tokens=48",
          "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "trainer.micro_batch_size=16",
          "weight_sync.bucket_mb=1", "trainer.loss.tis_cap=2.0")


def run_job(task_assets, tmp_path, engines, name: str, *overrides: str) -> tuple[list[dict], str]:
    """The job's metrics records, and its failed-request warnings (the reasons behind `samples_failed`). The job
    attaches to the session's shared `engines`."""
    become_subreaper()
    cmd = train_command(task_assets, tmp_path, *COMMON, f"run.name={name}", *engines.overrides(), *overrides)
    # ~40 s here: a job that runs 15 times longer has hung (with its hooks' frozen engines), and costs no more.
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env=hook_env(tmp_path / name))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert not leftovers(), "processes left running after the job"
    output = (result.stdout + result.stderr).splitlines()  # the scheduler's warnings are log records, on stderr
    failures = "\n".join(line for line in output if "slimish.rollout.scheduler: request" in line)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()], failures


def test_abort_mode_continues_aborted_requests_across_syncs(task_assets, tmp_path, attached):
    """With dynamic sampling on: every group a step trains has reward variance (groups without are replaced)."""
    records, failures = run_job(task_assets, tmp_path, attached, "abort", "rl.num_steps=4",
                                "rollout.partial.mode=abort",
                                "rollout.partial.over_sampling=4", "rollout.dynamic_sampling.enabled=true",
                                'rollout.stop=["e", "t"]', "reward.fn=tests.e2e.hooks.long_response_reward",
                                "run.save_rollouts=true")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        rows = (tmp_path / "abort" / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
        groups: dict[int, list[float]] = {}
        for row in map(json.loads, rows):
            if row["status"] in ("completed", "truncated"):
                groups.setdefault(row["group_id"], []).append(row["reward"])
        assert len(groups) == 4 and all(max(r) != min(r) for r in groups.values()), (step, groups)
    assert sum(r["groups_kept_uninformative"] for r in records) == 0
    assert sum(r["requests_aborted"] for r in records) > 0
    later = records[1:]
    assert sum(r["groups_continued"] for r in later) > 0, "aborted groups are continued in later steps"
    assert sum(r["samples_multi_segment"] for r in later) > 0, "some trained responses span two requests"
    assert max(r["staleness_max"] for r in later) >= 1, "continued tokens were sampled by an older policy"
    assert_versions_are_true(records)
    for record in records:
        assert record["samples_aborted"] == 0, "no aborted sample is trained"
        assert record["samples_failed"] == 0, failures
        assert 0 < record["tis_weight"] <= 2.0


def assert_versions_are_true(records: list[dict]) -> None:
    """Every token tagged with the current version matches the trainer (a stale token tagged current would not);
    tokens tagged older came from other weights (unless a step left the weights unchanged: no reward variance)."""
    for record in records:
        assert record["logprob_abs_diff_max"] <= 1e-4, record
    stale = [r["logprob_abs_diff_stale_mean"] for r in records if r["off_policy_token_frac"] > 0]
    assert stale and max(stale) > 1e-3, stale


def test_retract_mode_keeps_generating_through_weight_syncs(task_assets, tmp_path, attached):
    """The next step's groups generate while the trainer trains. Whether a sync finds one of their requests still
    running is not left to the speed of generation against training (this model generates a batch in ~0.2 s): the
    run.phase_hook of tests/e2e/hooks.py freezes the engines as training begins and, as the sync begins, lets them
    go until one is running requests; its rollout program sends the next step's requests only once the engines are
    frozen, so they cannot all have finished before. Without over-sampling, the groups a sync finds running are
    exactly the next step's batch, so each of steps 2-4 trains retracted responses. Health probes are off: a frozen
    engine would not answer them."""
    from tests.e2e import hooks

    records, failures = run_job(task_assets, tmp_path, attached, "retract", "rl.num_steps=4",
                                "rollout.partial.mode=retract",
                                "run.phase_hook=tests.e2e.hooks.hold_requests_for_syncs",
                                "rollout.generate_fn=tests.e2e.hooks.generate_once_frozen",
                                "rollout.engine.health_interval_s=0")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    held = [json.loads(line) for line in (tmp_path / "retract" / hooks.HELD_FOR_SYNC).read_text().splitlines()]
    assert [h["step"] for h in held] == [1, 2, 3, 4] and all(h["running"] > 0 for h in held), held
    for record in records[1:]:
        assert record["num_retractions"] > 0, "the step trains the requests its sync retracted"
        assert record["off_policy_token_frac"] > 0, "responses mix weight versions"
    assert_versions_are_true(records)
    for record in records:
        assert record["samples_aborted"] == 0 and record["samples_failed"] == 0, failures
