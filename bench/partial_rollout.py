"""Benchmark partial rollouts: the same RL job with rollout.partial.mode off, abort and retract, side by side.

    python bench/partial_rollout.py [--steps 8] [--workdir /tmp]      (or: make bench-partial)

Each mode runs `slimish train` on the quickstart config with an untrained tiny model (no SFT warm-up) whose
responses end at a stop string, which gives them a long-tailed (geometric) length distribution, the "contains the
digit" reward and the same seed; only rollout.partial.* differs. Per mode it prints the mean step
time over steps 2..N (step 1 has nothing to continue or overlap), the trained samples per second, the tokens the
engines generated per second and the mean staleness figures. The baseline is mode off, measured in the same run;
the last line is
    abort_vs_off_speedup=<x> retract_vs_off_speedup=<y>
with speedup = mean step time of off / mean step time of the mode (the same number of samples is trained per
step in every mode). Engine start-up (~1-2 min per job on a 2-core machine) is excluded.
"""

from __future__ import annotations

from rl_jobs import bench_parser, steady_state, train, workspace

MODES = {"off": [], "abort": ["rollout.partial.over_sampling=4"], "retract": ["rollout.partial.over_sampling=4"]}
# An untrained model samples near-uniformly: ending a response at the first "e" makes lengths geometric (measured:
# mean 28, median 22, 90th percentile 60, max 156 of 64), so a step's slowest sample is several times its mean.
JOB = ["sft.steps=0", "reward.fn=slimish.tasks.echo_digit.contains_reward", "rollout.stop=[e]",
       "rollout.max_new_tokens=256", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
       "trainer.micro_batch_size=32", "weight_sync.bucket_mb=1", "trainer.loss.tis_cap=2.0", "checkpoint.save_every=0",
       "eval.every=0"]


def main() -> None:
    args = bench_parser(__doc__, steps=8).parse_args()
    results = {}
    with workspace("partial", args.workdir) as (assets, runs):
        for mode in MODES:
            overrides = [f"rl.num_steps={args.steps}", f"rollout.partial.mode={mode}", *JOB, *MODES[mode]]
            results[mode] = steady_state(train(f"mode_{mode}", overrides, assets=assets, out=runs))
            r = results[mode]
            print(f"{mode:>8}: step {r['step_s']:.2f} s | {r['samples_per_s']:.1f} samples/s | engines "
                  f"{r['engine_tokens_per_s']:.0f} tok/s | off-policy tokens {r['off_policy_token_frac']:.2f} "
                  f"(max staleness {r['staleness_max']}) | reward {r['reward_mean']:.2f}", flush=True)
    off = results["off"]["step_s"]
    print(f"abort_vs_off_speedup={off / results['abort']['step_s']:.2f} "
          f"retract_vs_off_speedup={off / results['retract']['step_s']:.2f}")


if __name__ == "__main__":
    main()
