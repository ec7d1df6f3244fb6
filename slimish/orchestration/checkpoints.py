"""How an RL checkpoint is written so a crash never leaves a half-written checkpoint that looks complete, nor loses
the last complete one; which one a run resumes from; and pruning (where they live and which are complete:
`slimish.run_layout`).

Layout: <run dir>/checkpoints/step_<N>/{trainer/ (Megatron dist checkpoint), rollout_buffer.jsonl (groups generated
but not yet trained on: the partial-rollout buffer, one group per line), driver.json}. A checkpoint is written
into checkpoints/.partial-step_<N>/, every file and directory of it synced to disk, driver.json last, then renamed
to step_<N> (an atomic rename on one filesystem): a step_<N> directory with driver.json and trainer/ is complete;
anything else is ignored and `.partial-*` leftovers are deleted by the next save.

Re-saving a step that has a checkpoint (a resumed run saving the step it resumed from, say) keeps a complete copy
at every instant: the old step_<N> is renamed to `.replaced-step_<N>`, which `run_layout.complete_checkpoints`
counts as step N while step_<N> is absent; the new one is renamed into place; only then is the old one deleted. A
crash between the renames leaves the old one, which the next save (`begin`) puts back as step_<N> if it is still
missing.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from slimish.config.errors import ConfigError
from slimish.errors import UserError
from slimish.run_layout import (
    ARCHIVE,
    DRIVER_STATE,
    LINEAGE_FILE,
    REPLACED,
    ROLLOUT_BUFFER,
    checkpoints_dir,
    complete_checkpoints,
    is_complete,
    lineage_of,
)

_PARTIAL = ".partial-"


def resume_path(resume: str, run_dir: Path, lineage: str | None = None) -> Path | None:
    """The checkpoint to resume from for checkpoint.resume = `resume`: None for 'never' or for 'auto' with no
    complete checkpoint of run `lineage` (any run's, when None) in the run directory; an explicit path must be a
    complete checkpoint."""
    if resume == "never":
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir, lineage)
        return found[-1][1] if found else None
    path = Path(resume)
    if not is_complete(path):
        raise ConfigError("checkpoint.resume", f"{resume!r} is not a complete checkpoint (a step_<N> directory with "
                          "driver.json); use 'auto', 'never' or such a directory")
    return path


def current_lineage(run_dir: Path) -> str | None:
    """The run the directory continues: its lineage file, else (a directory from before lineages) the writer of
    its newest complete checkpoint, else None (a new directory)."""
    file = Path(run_dir) / LINEAGE_FILE
    if file.is_file():
        return file.read_text().strip()
    found = complete_checkpoints(run_dir)
    return lineage_of(found[-1][1]) if found else None


def start_lineage(run_dir: Path, resume: str, *, other_runs: str) -> tuple[str, Path | None]:
    """(the id of the run this job continues or starts, the checkpoint it resumes from). 'auto' continues the run
    the directory holds, from its newest complete checkpoint; 'never', or 'auto' with none, starts a new run, and so
    does an explicit checkpoint (under its writer's id). Checkpoints of any other run in the directory are never
    pruned, resumed or overwritten by this one: with `other_runs` 'refuse' the job stops in one line naming them;
    'archive' moves them (with the directory's metrics.jsonl, when this job starts fresh) to archive/<their id>/;
    'delete' deletes them. The chosen id is written to the directory's lineage file."""
    run_dir = Path(run_dir)
    # 'auto' in a directory without any run (current_lineage None) finds nothing either way.
    resume_from = resume_path(resume, run_dir, current_lineage(run_dir) if resume == "auto" else None)
    lineage = lineage_of(resume_from) if resume_from is not None else uuid.uuid4().hex[:12]
    others = [(step, path) for step, path in complete_checkpoints(run_dir) if lineage_of(path) != lineage]
    if others:
        _set_aside(run_dir, others, other_runs, fresh=resume_from is None)
    (run_dir / LINEAGE_FILE).write_text(lineage + "\n")
    return lineage, resume_from


def _set_aside(run_dir: Path, others: list[tuple[int, Path]], how: str, *, fresh: bool) -> None:
    steps = ", ".join(str(step) for step, _ in others)
    if how == "refuse":
        raise UserError(f"{run_dir} holds checkpoints of another run (steps {steps}), which this job would neither "
                        "resume nor keep apart from its own: resume them (checkpoint.resume=auto), set "
                        "checkpoint.other_runs=archive (moved to archive/) or =delete, or give this job another "
                        "run.name")
    newest = run_dir / ARCHIVE / (lineage_of(others[-1][1]) or "earlier")
    for _, path in others:
        if how == "delete":
            shutil.rmtree(path)
            continue
        target = run_dir / ARCHIVE / (lineage_of(path) or "earlier")
        target.mkdir(parents=True, exist_ok=True)
        path.rename(_unused(target / path.name.removeprefix(REPLACED)))
    metrics = run_dir / "metrics.jsonl"
    if how == "archive" and fresh and metrics.is_file():  # the metrics of the run whose newest checkpoint it was
        newest.mkdir(parents=True, exist_ok=True)
        metrics.rename(_unused(newest / "metrics.jsonl"))


def _unused(path: Path) -> Path:
    """`path`, or the first of path.1, path.2, ... that does not exist (an archive is never written over)."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


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
    """A fresh, empty staging directory for step `step`'s checkpoint. Stale staging directories are removed; a
    checkpoint moved aside by a re-save that crashed is put back as step_<N> when that is still missing, and
    deleted when the new step_<N> made it."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{_PARTIAL}*"):
        shutil.rmtree(stale, ignore_errors=True)
    for replaced in root.glob(f"{REPLACED}*"):
        final = root / replaced.name.removeprefix(REPLACED)
        if is_complete(final):
            shutil.rmtree(replaced, ignore_errors=True)
        elif is_complete(replaced):
            if final.exists():  # an incomplete leftover under the name: never a checkpoint
                shutil.rmtree(final)
            replaced.rename(final)
            _fsync_dir(root)
    staging = root / f"{_PARTIAL}step_{step}"
    staging.mkdir()
    return staging


def commit(staging: Path, driver_state: dict) -> Path:
    """Sync everything in `staging` to disk, write driver.json into it (synced), then rename it to
    step_<driver_state['step']>; returns that path. An existing checkpoint of the same step is replaced with a
    complete copy of the step on disk at every instant (see the module docstring)."""
    root = staging.parent
    final = root / f"step_{driver_state['step']}"
    _fsync_tree(staging)  # the trainer's files are complete on disk before anything is replaced
    with (staging / DRIVER_STATE).open("w") as f:
        json.dump(driver_state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(staging)
    replaced = None
    if is_complete(final) and lineage_of(final) != driver_state.get("lineage", ""):
        raise UserError(f"{final} is a checkpoint of another run: it is not replaced (move it away, or set "
                        "checkpoint.other_runs=archive)")
    if final.exists():
        replaced = root / f"{REPLACED}{final.name}"
        if replaced.exists():  # an older copy set aside by a crashed re-save, and step_<N> is complete: it goes
            shutil.rmtree(replaced)
        final.rename(replaced)  # from here, .replaced-step_<N> stands for step N (run_layout.complete_checkpoints)
        _fsync_dir(root)
    staging.rename(final)
    _fsync_dir(root)
    if replaced is not None:
        shutil.rmtree(replaced)
    return final


def prune(run_dir: Path, keep_last: int, lineage: str | None = None) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints of run `lineage` (of the directory, when None; 0
    keeps all); returns the deleted paths. Another run's checkpoints are never counted or deleted."""
    if keep_last == 0:
        return []
    old = [path for _, path in complete_checkpoints(run_dir, lineage)[:-keep_last]]
    for path in old:
        shutil.rmtree(path)
    return old


def _fsync_tree(path: Path) -> None:
    """fsync every file and directory under `path` (Megatron's writers close their files without syncing them)."""
    for folder, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
