"""Where a run's checkpoints live and which of them are complete: facts of the run directory that the config
checks (an explicit `checkpoint.resume`), the driver and the tests read alike. Writing checkpoints is
`slimish.orchestration.checkpoints`' job.

Layout: <run dir>/checkpoints/step_<N>/{trainer/ (Megatron dist checkpoint), rollout_buffer.jsonl, driver.json}. A
step_<N> directory holding driver.json and trainer/ is complete (the writer renames it into place, driver.json
written last); anything else is ignored.
"""

from __future__ import annotations

import re
from pathlib import Path

DRIVER_STATE = "driver.json"
TRAINER_DIR = "trainer"
ROLLOUT_BUFFER = "rollout_buffer.jsonl"
STEP_DIR = re.compile(r"step_(\d+)")


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
        match = STEP_DIR.fullmatch(child.name)
        if match and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)
