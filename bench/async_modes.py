"""Benchmark asynchronous training: the same RL job with rl.mode sync, one_step_off and async, side by side.

    python bench/async_modes.py [--steps 10] [--workdir /tmp]      (or: make bench-async)

The workload is the partial-rollout benchmark's (bench/partial_rollout.py): an untrained tiny model whose responses
end at a stop string, so their lengths are long-tailed (geometric), the "contains the digit" reward, the same seed.
Every mode trains the same number of samples per step (prompts_per_step groups); only how generation overlaps
training differs:
    sync          rollout, train, sync in turn (rollout.partial.mode off): the baseline, measured in the same run;
    one_step_off  step N+1's rollout runs while step N trains, then the sync (partial mode off);
    async         generation never stops (partial mode retract, 4 groups over-sampled), weights sync every 2 steps.
Per mode it prints the mean step time over steps 2..N, where the time went, samples per second and the staleness
seen. The last line is
    one_step_off_vs_sync=<x> async_vs_sync=<y> max_staleness_seen=<k>
with <x>, <y> = mean step time of sync / mean step time of the mode, and <k> the largest version gap between a
trained token and the policy that trained it, in any mode (rollout.partial.max_staleness bounds it: 4).
"""

from __future__ import annotations

from partial_rollout import JOB
from rl_jobs import bench_parser, steady_state, train, workspace

MODES = {
    "sync": ["rl.mode=sync", "rollout.partial.mode=off"],
    "one_step_off": ["rl.mode=one_step_off", "rollout.partial.mode=off"],
    "async": ["rl.mode=async", "rl.sync_every=2", "rollout.partial.mode=retract", "rollout.partial.over_sampling=4"],
}


def main() -> None:
    args = bench_parser(__doc__, steps=10).parse_args()
    results = {}
    with workspace("async", args.workdir) as (assets, runs):
        for mode, overrides in MODES.items():
            records = train(mode, [f"rl.num_steps={args.steps}", *JOB, *overrides], assets=assets, out=runs)
            r = results[mode] = steady_state(records)
            print(f"{mode:>12}: step {r['step_s']:.2f} s (waiting for rollout {r['rollout_s']:.2f} s, train "
                  f"{r['train_s']:.2f} s, sync {r['sync_s']:.2f} s) | {r['samples_per_s']:.1f} samples/s | "
                  f"off-policy tokens {r['off_policy_token_frac']:.2f} (max staleness {r['staleness_max']}) | "
                  f"reward {r['reward_mean']:.2f}", flush=True)
    base = results["sync"]["step_s"]
    print(f"one_step_off_vs_sync={base / results['one_step_off']['step_s']:.2f} "
          f"async_vs_sync={base / results['async']['step_s']:.2f} "
          f"max_staleness_seen={max(r['staleness_max'] for r in results.values())}")


if __name__ == "__main__":
    main()
