"""What the RL benchmarks share: tiny task assets, and `slimish train` on the quickstart config with overrides.

Each benchmark runs its variants one after another in the same invocation, so that every figure has its baseline
measured on the same machine at the same time."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs/quickstart_cpu.yaml"


def bench_parser(doc: str, *, steps: int) -> argparse.ArgumentParser:
    """The options every RL benchmark takes: --steps (per job) and --workdir (its scratch directory's parent)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--workdir", default="/tmp")
    return parser


@contextlib.contextmanager
def workspace(name: str, workdir: str):
    """A scratch directory under `workdir` holding the tiny assets: yields (assets, where runs go); removed after."""
    root = Path(tempfile.mkdtemp(prefix=f"slimish-bench-{name}-", dir=workdir))
    try:
        yield make_assets(root / "assets"), root / "runs"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def make_assets(out: Path, *extra: str) -> Path:
    """A tiny random model and the task's data files (`slimish make-tiny`), in `out`."""
    subprocess.run([sys.executable, "-m", "slimish.cli", "make-tiny", "--out", str(out), *extra], check=True,
                   capture_output=True, cwd=REPO)
    return out


def train(name: str, overrides: list[str], *, assets: Path, out: Path, config: Path = QUICKSTART,
          tree: Path = REPO) -> list[dict]:
    """`slimish train` of `config` on `assets` as run `name` under `out`, with the slimish of the source tree `tree`
    (another checkout: a baseline; every process of the job imports it, through PYTHONPATH); returns its
    metrics.jsonl records."""
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree != REPO else None
    cmd = [sys.executable, "-m", "slimish.cli", "train", str(config),
           f"model.hf_path={assets / 'model'}", f"data.path={assets / 'train.jsonl'}",
           f"sft.data_path={assets / 'sft.jsonl'}", f"run.output_dir={out}", f"run.name={name}", "eval.every=0",
           *overrides]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env)
    if result.returncode:
        raise RuntimeError(f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def steady_state(records: list[dict], skip: int = 1) -> dict:
    """Means over the records after the first `skip` steps (which have nothing to continue or overlap yet)."""
    steady = records[skip:]
    step_s = statistics.mean(r["time_step_s"] for r in steady)
    samples = statistics.mean(r["samples_completed"] + r["samples_truncated"] for r in steady)
    return {"step_s": step_s, "samples_per_s": samples / step_s,
            "engine_tokens_per_s": sum(r["engine_tokens"] for r in steady) / sum(r["time_step_s"] for r in steady),
            "off_policy_token_frac": statistics.mean(r["off_policy_token_frac"] for r in steady),
            "staleness_max": max(r["staleness_max"] for r in steady),
            "reward_mean": statistics.mean(r["reward_mean"] for r in steady),
            "rollout_s": statistics.mean(r["time_rollout_s"] for r in steady),
            "train_s": statistics.mean(r["time_train_s"] for r in steady),
            "sync_s": statistics.mean(r["time_sync_s"] for r in steady)}
