"""Where RL checkpoints live, which of them are complete, and how one is written so a crash never leaves a
half-written checkpoint that looks complete.

Layout: <run dir>/checkpoints/step_<N>/{trainer/ (Megatron dist checkpoint), rollout_buffer.jsonl (groups generated
but not yet trained on: the partial-rollout buffer, one group per line), driver.json}. A checkpoint is written
into checkpoints/.partial-step_<N>/, driver.json last, then renamed to step_<N> (an atomic rename on one
filesystem): a step_<N> directory with driver.json and trainer/ is complete; anything else is ignored and
`.partial-*` leftovers are deleted by the next save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from slimish.config.loader import ConfigError

DRIVER_STATE = "driver.json"
TRAINER_DIR = "trainer"
ROLLOUT_BUFFER = "rollout_buffer.jsonl"
_STEP_DIR = re.compile(r"step_(\d+)")
_PARTIAL = ".partial-"


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def is_complete(path: Path) -> bool:
    path = Path(path)
    return (path / DRIVER_STATE).is_file() and (path / TRAINER_DIR).is_dir()


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint of the run, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


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
