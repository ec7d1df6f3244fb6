"""Per-step metrics: one JSON object per line in metrics.jsonl, TensorBoard scalars, and one printed line."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path


class PhaseTimer:
    """`with timer("rollout"):` records `time_rollout_s` into the current step's metrics."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.times[f"time_{phase}_s"] = time.monotonic() - t0

    def pop(self) -> dict[str, float]:
        times, self.times = self.times, {}
        return times


class MetricsLogger:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "metrics.jsonl"
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def format_line(step: int, total: int, m: dict) -> str:
    return (f"step {step:>3}/{total} | reward {m['reward_mean']:.3f} | len {m['response_len_mean']:.1f} | "
            f"ppo_kl {m['ppo_kl']:.2e} | lp_diff {m['logprob_abs_diff_max']:.1e} | "
            f"rollout {m['time_rollout_s']:.1f}s train {m['time_train_s']:.1f}s sync {m['time_sync_s']:.1f}s | "
            f"{m['tokens_per_s']:.0f} tok/s")
