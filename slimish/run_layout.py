"""Where a run's checkpoints live and which of them are complete: facts of the run directory that the config
checks (an explicit `checkpoint.resume`), the driver and the tests read alike. Writing checkpoints is
`slimish.orchestration.checkpoints`' job.

Layout: <run dir>/checkpoints/step_<N>/{trainer/ (Megatron dist checkpoint), rollout_buffer.jsonl, driver.json}. A
step_<N> directory holding driver.json and trainer/ is complete (the writer renames it into place, driver.json
written last); anything else is ignored, except `.replaced-step_<N>`: the complete checkpoint a re-save of step N
moved aside, which stands for step N until the new step_<N> is in place (a crash between the two renames leaves it
the only copy).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from slimish.errors import UserError

DRIVER_STATE = "driver.json"
TRAINER_DIR = "trainer"
ROLLOUT_BUFFER = "rollout_buffer.jsonl"
STEP_DIR = re.compile(r"step_(\d+)")
REPLACED = ".replaced-"  # a complete step_<N> moved aside while its re-save takes its place
LINEAGE_FILE = "lineage"  # <run dir>/lineage: the id of the run the directory continues (its checkpoints carry it)
ARCHIVE = "archive"  # <run dir>/archive/<lineage>/: another run's checkpoints and metrics, moved aside


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def is_complete(path: Path) -> bool:
    path = Path(path)
    return (path / DRIVER_STATE).is_file() and (path / TRAINER_DIR).is_dir()


def lineage_of(checkpoint: Path) -> str:
    """The id of the run that wrote a complete checkpoint ("" for one written before runs had ids)."""
    return str(json.loads((Path(checkpoint) / DRIVER_STATE).read_text()).get("lineage", ""))


def complete_checkpoints(run_dir: Path, lineage: str | None = None) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint of the run directory (of run `lineage` only, when given),
    oldest first."""
    found = _complete_checkpoints(run_dir)
    if lineage is None:
        return found
    return [(step, path) for step, path in found if lineage_of(path) == lineage]


def _complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for child in root.iterdir():
        match = STEP_DIR.fullmatch(child.name)
        if match and is_complete(child):
            found[int(match.group(1))] = child
    for child in root.glob(f"{REPLACED}step_*"):
        match = STEP_DIR.fullmatch(child.name.removeprefix(REPLACED))
        if match and int(match.group(1)) not in found and is_complete(child):
            found[int(match.group(1))] = child
    return sorted(found.items())


class UnreadableMetrics(UserError, ValueError):
    """A line of a metrics.jsonl that is not a record, before its last line: one line naming the file and line."""


@dataclass(frozen=True)
class MetricsLines:
    """What a metrics.jsonl holds: its records (one JSON object with an integer "step" per line), each with the text
    of its line, and the number of its last line when that one was cut (`read_metrics_lines`)."""
    records: list[dict]
    lines: list[str]
    cut_line: int | None
    ends_cleanly: bool  # the file ends with a newline (or is empty): the next record can be appended to it


def read_metrics_lines(path: Path) -> MetricsLines:
    """The records of the jsonl file `path`. A last line that is not a complete record (the job killed in the middle
    of a write, a full disk) is left out and its number returned in `cut_line`: it never held a whole step. Any
    other line that is not a JSON object with an integer "step" is `UnreadableMetrics` naming the file and line."""
    text = Path(path).read_text(errors="replace")
    raw = text.split("\n")
    if raw and raw[-1] == "":
        raw.pop()
    records, lines, cut = [], [], None
    for number, line in enumerate(raw, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a JSON object with an integer \"step\"")
        except ValueError as exc:
            if number == len(raw):
                cut = number
                break
            raise UnreadableMetrics(f"{path}:{number}: cannot read this line ({exc}): fix or remove it") from None
        records.append(record)
        lines.append(line)
    return MetricsLines(records, lines, cut, ends_cleanly=text == "" or text.endswith("\n"))


SYNC_PREFIX = "sync-"  # the disk transport's directory per sync (slimish/weight_sync/disk.py)


def weight_sync_root(disk_dir: str, run_dir: Path) -> Path:
    """Where the run at `run_dir` writes its sync directories: <run dir>/weight_sync, or under a shared
    weight_sync.disk_dir a directory of its own (<run name>-<hash of the run dir's path>), so that a job's start
    removes what a dead job of the same run left (`remove_sync_leftovers`) and never another run's shards."""
    if not disk_dir:
        return run_dir / "weight_sync"
    tag = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:10]
    return Path(disk_dir) / f"{run_dir.name}-{tag}"


def remove_sync_leftovers(root: Path) -> int:
    """Remove the sync directories under `root` (a run's `weight_sync_root`) that a job left when it died in the middle
    of a sync: a whole model copy each. Only safe while the run directory's lock is held (no sync of the run can be
    running). Returns how many were removed."""
    leftovers = sorted(root.glob(f"{SYNC_PREFIX}*")) if root.is_dir() else []
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return len(leftovers)
