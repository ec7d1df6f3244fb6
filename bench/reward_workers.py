"""Does running the reward hook in worker processes slow a step? The quickstart with the hook in the rollout process
(`reward.workers=0`, the baseline) and in two worker processes (`reward.workers=2`, the default), same seed and data.

    python bench/reward_workers.py [--steps 30] [--workdir /tmp]   (or: make bench-reward-workers)

Per setting: the mean step time and rollout time over the steps after the first, and the last step's reward. Then
the cost of scoring one group of 8 completions (the quickstart's), the median of 300 calls, in process and through a
worker: what the workers add to a step is this difference times the step's groups. The last line is
    workers_vs_in_process_step_time=<ratio> group_ms_in_process=<ms> group_ms_workers=<ms>
(1.0: no cost; on a 2-core machine whole steps vary by 10-20% from run to run, the per-group figures do not).
About 2 minutes in all on a 2-core machine.
"""

from __future__ import annotations

import statistics
import time

from rl_jobs import bench_parser, train, workspace


def main() -> None:
    args = bench_parser(__doc__, steps=30).parse_args()
    step_s = {}
    with workspace("reward-workers", args.workdir) as (assets, runs):
        for workers in (0, 2):
            records = train(f"workers{workers}", [f"rl.num_steps={args.steps}", f"reward.workers={workers}"],
                            assets=assets, out=runs)
            steady = records[1:]
            step_s[workers] = statistics.mean(r["time_step_s"] for r in steady)
            rollout_s = statistics.mean(r["time_rollout_s"] for r in steady)
            print(f"reward.workers={workers}: step {step_s[workers]:.3f} s | rollout {rollout_s:.3f} s | "
                  f"reward {records[0]['reward_mean']:.3f} -> {records[-1]['reward_mean']:.3f}", flush=True)
    in_process_ms, workers_ms = group_costs()
    print(f"scoring one group of 8: {in_process_ms:.2f} ms in process, {workers_ms:.2f} ms through a worker")
    print(f"workers_vs_in_process_step_time={step_s[2] / step_s[0]:.3f} group_ms_in_process={in_process_ms:.2f} "
          f"group_ms_workers={workers_ms:.2f}")


def group_costs(calls: int = 300) -> tuple[float, float]:
    """Median milliseconds to score one quickstart group: in process (`reward.workers: 0`) and through a worker."""
    from slimish.config.schema import RewardConfig
    from slimish.rollout.reward_workers import InProcessReward, RewardWorkers
    from slimish.rollout.rewards import build_reward_fn
    from slimish.sample import Sample, Status

    def group():
        return [Sample(group_id=0, index=i, prompt="say 7", prompt_ids=[1] * 8, label="7", response="7",
                       response_ids=[1, 2], rollout_logprobs=[0.0, 0.0], weight_versions=[0, 0], loss_mask=[1, 1],
                       status=Status.COMPLETED, columns={"prompt": "say 7", "label": "7"}) for i in range(8)]

    cfg = RewardConfig(fn="slimish.tasks.echo_digit.reward")
    workers = RewardWorkers(cfg, workers=2, timeout_s=60, failure_reward=0.0)
    try:
        costs = []
        for scorer in (InProcessReward(build_reward_fn(cfg), timeout_s=60, failure_reward=0.0), workers):
            times = []
            for _ in range(calls):
                samples, t0 = group(), time.perf_counter()
                scorer.score(samples)
                times.append(time.perf_counter() - t0)
            costs.append(statistics.median(times) * 1e3)
    finally:
        workers.close()
    return costs[0], costs[1]


if __name__ == "__main__":
    main()
