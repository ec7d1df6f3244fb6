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
    """Appends to metrics.jsonl. `resume_after=N` (a resumed run) first drops records of steps > N, which an
    interrupted run logged after its last checkpoint, and TensorBoard events of those steps likewise."""

    def __init__(self, run_dir: Path, *, resume_after: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "metrics.jsonl"
        if resume_after is None:
            self.path.unlink(missing_ok=True)
        else:
            truncate_metrics(self.path, resume_after)
        purge = None if resume_after is None else resume_after + 1
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)

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


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only the records of steps <= `last_step` in the jsonl file `path` (if it exists)."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line)["step"] <= last_step]
    if len(kept) != len(lines):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)


def format_line(step: int, total: int, m: dict) -> str:
    return (f"step {step:>3}/{total} | reward {m['reward_mean']:.3f} | len {m['response_len_mean']:.1f} | "
            f"ppo_kl {m['ppo_kl']:.2e} | lp_diff {m['logprob_abs_diff_max']:.1e} | "
            f"rollout {m['time_rollout_s']:.1f}s train {m['time_train_s']:.1f}s sync {m['time_sync_s']:.1f}s | "
            f"{m['tokens_per_s']:.0f} tok/s")
