"""Does running the reward hook in worker processes slow a step? The quickstart with the hook in the rollout process
(`reward.workers=0`, the baseline) and in two worker processes (`reward.workers=2`, the default), same seed and data.

    python bench/reward_workers.py [--steps 30] [--workdir /tmp]   (or: make bench-reward-workers)

Per setting: the mean step time and rollout time over the steps after the first, and the last step's reward. The
last line is
    workers_vs_in_process_step_time=<ratio>
(1.0: no cost; above 1: the workers slow a step). About 2 minutes in all on a 2-core machine.
"""

from __future__ import annotations

import statistics

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
    print(f"workers_vs_in_process_step_time={step_s[2] / step_s[0]:.3f}")


if __name__ == "__main__":
    main()
