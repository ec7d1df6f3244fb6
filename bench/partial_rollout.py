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

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {"off": [], "abort": ["rollout.partial.over_sampling=4"], "retract": ["rollout.partial.over_sampling=4"]}
# An untrained model samples near-uniformly: ending a response at the first "e" makes lengths geometric (measured:
# mean 28, median 22, 90th percentile 60, max 156 of 64), so a step's slowest sample is several times its mean.
JOB = ["sft.steps=0", "reward.fn=slimish.tasks.echo_digit.contains_reward", "rollout.stop=[e]",
       "rollout.max_new_tokens=256", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
       "trainer.micro_batch_size=32", "weight_sync.bucket_mb=1", "trainer.loss.tis_cap=2.0", "checkpoint.save_every=0",
       "eval.every=0"]


def run_mode(mode: str, *, assets: Path, out: Path, steps: int) -> list[dict]:
    cmd = [sys.executable, "-m", "slimish.cli", "train", "--config", str(REPO / "configs/quickstart_cpu.yaml"),
           f"model.hf_path={assets / 'model'}", f"data.path={assets / 'train.jsonl'}", f"run.output_dir={out}",
           f"run.name=mode_{mode}", f"rl.num_steps={steps}", f"rollout.partial.mode={mode}", *JOB, *MODES[mode]]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if result.returncode:
        raise RuntimeError(f"mode {mode} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return [json.loads(line) for line in (out / f"mode_{mode}" / "metrics.jsonl").read_text().splitlines()]


def summarize(records: list[dict]) -> dict:
    steady = records[1:]
    step_s = statistics.mean(r["time_step_s"] for r in steady)
    samples = statistics.mean(r["samples_completed"] + r["samples_truncated"] for r in steady)
    return {"step_s": step_s, "samples_per_s": samples / step_s,
            "engine_tokens_per_s": sum(r["engine_tokens"] for r in steady) / sum(r["time_step_s"] for r in steady),
            "off_policy_token_frac": statistics.mean(r["off_policy_token_frac"] for r in steady),
            "staleness_max": max(r["staleness_max"] for r in steady),
            "reward_mean": statistics.mean(r["reward_mean"] for r in steady)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workdir", default="/tmp")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="slimish-bench-partial-", dir=args.workdir))
    try:
        subprocess.run([sys.executable, "-m", "slimish.cli", "make-tiny", "--out", str(root / "assets")],
                       check=True, capture_output=True, cwd=REPO)
        results = {}
        for mode in MODES:
            results[mode] = summarize(run_mode(mode, assets=root / "assets", out=root / "runs", steps=args.steps))
            r = results[mode]
            print(f"{mode:>8}: step {r['step_s']:.2f} s | {r['samples_per_s']:.1f} samples/s | engines "
                  f"{r['engine_tokens_per_s']:.0f} tok/s | off-policy tokens {r['off_policy_token_frac']:.2f} "
                  f"(max staleness {r['staleness_max']}) | reward {r['reward_mean']:.2f}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    off = results["off"]["step_s"]
    print(f"abort_vs_off_speedup={off / results['abort']['step_s']:.2f} "
          f"retract_vs_off_speedup={off / results['retract']['step_s']:.2f}")


if __name__ == "__main__":
    main()
