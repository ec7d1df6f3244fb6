"""The quickstart's RL step time at this tree against a baseline commit, measured in the same run.

  python bench/step_time.py [--baseline REV] [--steps 12] [--rounds 2]

Checks the baseline out into a scratch git worktree and runs the quickstart job (no SFT warm-up, no evaluation) on
the same tiny assets with each tree in turn, `--rounds` times, the order swapped every round, so that both see the
machine alike. A job's steady-state step time is the mean of `time_step_s` after its first step. Each round gives a
ratio (this tree's step time over the baseline's in that round); the last line is the median of those ratios (below
1: faster), beside each tree's median step time.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_jobs import REPO, bench_parser, steady_state, train, workspace  # noqa: E402


def main() -> None:
    parser = bench_parser(__doc__, steps=12)
    parser.add_argument("--baseline", default="HEAD~1", help="the commit to compare with (a git revision)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    tree = Path(tempfile.mkdtemp(prefix="slimish-baseline-", dir=args.workdir))
    added = subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), args.baseline], cwd=REPO,
                           capture_output=True, text=True)
    if added.returncode:
        shutil.rmtree(tree, ignore_errors=True)
        said = (added.stderr.strip() or "git said nothing").splitlines()[-1]
        sys.exit(f"--baseline {args.baseline}: git cannot check it out ({said})")
    try:
        figures: dict[str, list[dict]] = {"this": [], "baseline": []}
        with workspace("step-time", args.workdir) as (assets, runs):
            for round_ in range(args.rounds):
                order = (("baseline", tree), ("this", REPO))
                for name, source in order if round_ % 2 == 0 else order[::-1]:
                    records = train(f"{name}{round_}", [f"rl.num_steps={args.steps}", "sft.steps=0"], assets=assets,
                                    out=runs, tree=source)
                    figures[name].append(steady_state(records))
                    sys.stdout.write(f"{name} round {round_}: step {figures[name][-1]['step_s']:.3f}s, train "
                                     f"{figures[name][-1]['train_s']:.3f}s, sync {figures[name][-1]['sync_s']:.3f}s\n")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
        shutil.rmtree(tree, ignore_errors=True)
    medians = {name: {key: statistics.median(f[key] for f in runs) for key in ("step_s", "train_s", "sync_s")}
               for name, runs in figures.items()}
    for name, m in medians.items():
        sys.stdout.write(f"{name}: step {m['step_s']:.3f}s train {m['train_s']:.3f}s sync {m['sync_s']:.3f}s\n")
    ratios = [this["step_s"] / base["step_s"] for this, base in zip(figures["this"], figures["baseline"])]
    sys.stdout.write(f"round ratios: {' '.join(f'{r:.3f}' for r in ratios)}\n")
    sys.stdout.write(f"step_time_vs_baseline={statistics.median(ratios):.3f}\n")


if __name__ == "__main__":
    main()
