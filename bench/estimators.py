"""The quickstart task with every advantage estimator: does the reward rise, and how far against GRPO?

    python bench/estimators.py [--steps 30] [--estimators grpo,ppo,...] [--workdir /tmp]   (or: make bench-estimators)

Each estimator runs `slimish train` on configs/quickstart_cpu.yaml (its short SFT warm-up, then RL), same seed and
data, only `trainer.loss.advantage_estimator` differing (ppo with its critic at the trainer.critic defaults, gspo
with the sequence-level clip range the README gives); no evaluation. Per estimator it prints the mean reward of the
first 3 and the last 3 steps and the rise between them. The baseline is grpo, run in the same invocation; the last
line is
    estimators_rising=<n>/<total> min_rise=<x> min_rise_vs_grpo=<y>
with rise = last-3 mean - first-3 mean. About 2 minutes per estimator on a 2-core machine.
"""

from __future__ import annotations

from rl_jobs import bench_parser, train, workspace

ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gspo", "ppo"]
EXTRA = {"gspo": ["trainer.loss.clip_eps_low=3e-4", "trainer.loss.clip_eps_high=4e-4"]}  # README: sequence clipping


def main() -> None:
    parser = bench_parser(__doc__, steps=30)
    parser.add_argument("--estimators", default=",".join(ESTIMATORS))
    args = parser.parse_args()
    names = args.estimators.split(",")
    if "grpo" not in names:
        names.insert(0, "grpo")  # the baseline
    rises = {}
    with workspace("estimators", args.workdir) as (assets, runs):
        for name in names:
            overrides = [f"rl.num_steps={args.steps}", f"trainer.loss.advantage_estimator={name}", *EXTRA.get(name, [])]
            rewards = [r["reward_mean"] for r in train(name, overrides, assets=assets, out=runs)]
            first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
            rises[name] = last - first
            print(f"{name:>29}: first-3 mean {first:.3f} | last-3 mean {last:.3f} | rise {last - first:+.3f} | "
                  f"per step {' '.join(f'{r:.2f}' for r in rewards)}", flush=True)
    worst = min(rises.values())
    print(f"estimators_rising={sum(r > 0 for r in rises.values())}/{len(rises)} min_rise={worst:.3f} "
          f"min_rise_vs_grpo={worst / rises['grpo']:.2f}")


if __name__ == "__main__":
    main()
