"""Per-step metrics: one JSON object per line in metrics.jsonl, TensorBoard scalars, and one printed line."""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from pathlib import Path

from slimish.run_layout import read_metrics_lines

logger = logging.getLogger(__name__)


class PhaseTimer:
    """`with timer("rollout"):` adds its seconds to `time_rollout_s` of the current step's metrics."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.monotonic()
        try:
            yield
        finally:
            key = f"time_{phase}_s"
            self.times[key] = self.times.get(key, 0.0) + time.monotonic() - t0

    def pop(self) -> dict[str, float]:
        times, self.times = self.times, {}
        return times


def startup_metrics(weights_read: list[dict]) -> dict[str, float]:
    """The start-up's per-rank costs of reading the initial weights (`InitialWeights.report` of every trainer rank):
    the largest over the ranks of the bytes the HF reader requested (0 from a torch_dist checkpoint), the process's
    rchar and read_bytes (0 from the page cache; see docs/cpu-notes.md), and the seconds."""
    return {f"startup_weights_{key}_max": float(max(rank[key] for rank in weights_read))
            for key in ("requested", "rchar", "read_bytes")} | {
        "startup_weights_s_max": max(rank["seconds"] for rank in weights_read)}


class MetricsLogger:
    """Appends to metrics.jsonl, TensorBoard and, with `wandb_project`, Weights & Biases. `resume_after=N` (a
    resumed run) first drops records of steps > N, which an interrupted run logged after its last checkpoint, and
    TensorBoard events of those steps likewise (W&B resumes the run of the same id, run_dir/wandb_id)."""

    def __init__(self, run_dir: Path, *, resume_after: int | None = None, wandb_project: str = "",
                 run_name: str = "", config: dict | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "metrics.jsonl"
        if resume_after is None:
            self.path.unlink(missing_ok=True)
        else:
            truncate_metrics(self.path, resume_after)
        purge = None if resume_after is None else resume_after + 1
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        self.wandb = None
        if wandb_project:
            self.wandb = _wandb_run(run_dir, wandb_project, run_name, config or {}, resume=resume_after is not None)

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        """Flush and close every sink. W&B's finish() returns before its core process has written the run's data
        file (an offline run read right after it could still be a bare header); teardown() waits for that."""
        self.writer.close()
        if self.wandb is not None:
            import wandb

            self.wandb.finish()
            wandb.teardown()


def _wandb_run(run_dir: Path, project: str, name: str, config: dict, *, resume: bool):
    """A W&B run for this job (WANDB_MODE=offline writes it under run_dir/wandb for a later `wandb sync`). Its id
    is kept in run_dir/wandb_id so that a resumed job continues the same W&B run."""
    import wandb

    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if resume and id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    return wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(run_dir), config=config)


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only the records of steps <= `last_step` in the jsonl file `path` (if it exists). A last line cut by an
    interrupted write is dropped with a warning (the next record is then appended to a whole line); another
    unreadable line is a ValueError naming the file and line (`read_metrics_lines`)."""
    if not path.is_file():
        return
    found = read_metrics_lines(path)
    if found.cut_line is not None:
        logger.warning("%s:%d: the last line was cut (the run was interrupted while writing it): dropped", path,
                       found.cut_line)
    kept = [line for line, record in zip(found.lines, found.records, strict=True) if record["step"] <= last_step]
    if len(kept) != len(found.lines) or found.cut_line is not None or not found.ends_cleanly:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)


def format_line(step: int, total: int, m: dict) -> str:
    return (f"step {step:>3}/{total} | reward {m['reward_mean']:.3f} | len {m['response_len_mean']:.1f} | "
            f"ppo_kl {m['ppo_kl']:.2e} | lp_diff {m['logprob_abs_diff_max']:.1e} | "
            f"rollout {m['time_rollout_s']:.1f}s train {m['time_train_s']:.1f}s sync {m['time_sync_s']:.1f}s | "
            f"{m['tokens_per_s']:.0f} tok/s")
