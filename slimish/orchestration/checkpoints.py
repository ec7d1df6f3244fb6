"""How an RL checkpoint is written so a crash never leaves a half-written checkpoint that looks complete, which one
a run resumes from, and pruning (where they live and which are complete: `slimish.run_layout`).

Layout: <run dir>/checkpoints/step_<N>/{trainer/ (Megatron dist checkpoint), rollout_buffer.jsonl (groups generated
but not yet trained on: the partial-rollout buffer, one group per line), driver.json}. A checkpoint is written
into checkpoints/.partial-step_<N>/, driver.json last, then renamed to step_<N> (an atomic rename on one
filesystem): a step_<N> directory with driver.json and trainer/ is complete; anything else is ignored and
`.partial-*` leftovers are deleted by the next save.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from slimish.config.loader import ConfigError
from slimish.run_layout import DRIVER_STATE, ROLLOUT_BUFFER, checkpoints_dir, complete_checkpoints, is_complete

_PARTIAL = ".partial-"


def resume_path(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint to resume from for checkpoint.resume = `resume`: None for 'never' or for 'auto' with no
    complete checkpoint in the run directory; an explicit path must be a complete checkpoint."""
    if resume == "never":
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1][1] if found else None
    path = Path(resume)
    if not is_complete(path):
        raise ConfigError("checkpoint.resume", f"{resume!r} is not a complete checkpoint (a step_<N> directory with "
                          "driver.json); use 'auto', 'never' or such a directory")
    return path


def read_driver_state(path: Path) -> dict:
    return json.loads((Path(path) / DRIVER_STATE).read_text())


def write_rollout_buffer(staging: Path, groups: list[dict]) -> None:
    with (Path(staging) / ROLLOUT_BUFFER).open("w") as f:
        for group in groups:
            f.write(json.dumps(group) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_rollout_buffer(path: Path) -> list[dict]:
    """The groups saved with a checkpoint (none for a checkpoint written before the buffer existed)."""
    file = Path(path) / ROLLOUT_BUFFER
    if not file.is_file():
        return []
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def begin(run_dir: Path, step: int) -> Path:
    """A fresh, empty staging directory for step `step`'s checkpoint (stale staging directories are removed)."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{_PARTIAL}*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = root / f"{_PARTIAL}step_{step}"
    staging.mkdir()
    return staging


def commit(staging: Path, driver_state: dict) -> Path:
    """Write driver.json into `staging` (fsynced), then rename it to step_<driver_state['step']>; returns that path.
    An existing checkpoint of the same step is replaced."""
    final = staging.parent / f"step_{driver_state['step']}"
    with (staging / DRIVER_STATE).open("w") as f:
        json.dump(driver_state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        old = staging.parent / f"{_PARTIAL}old-{final.name}"
        final.rename(old)  # from here until the rename below, the older complete checkpoints remain
        shutil.rmtree(old)
    staging.rename(final)
    _fsync_dir(staging.parent)
    return final


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (0 keeps all); returns the deleted paths."""
    if keep_last == 0:
        return []
    old = [path for _, path in complete_checkpoints(run_dir)[:-keep_last]]
    for path in old:
        shutil.rmtree(path)
    return old


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
