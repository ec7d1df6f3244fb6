"""One job per run directory (`slimish.orchestration.run_lock`): a second job refuses in one line naming the holder,
before it writes anything; a lock whose holder was killed is taken over; `slimish train` on a held directory exits 2
with that line and leaves the directory as it was (on main at a706c6e the second job replaced the first one's
config.yaml, job key and metrics)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from slimish.orchestration.run_lock import RunDirectoryBusy, RunLock
from tests.conftest import REPO


def test_a_second_holder_is_refused_naming_the_first_and_may_take_it_after_release(tmp_path):
    first = RunLock(tmp_path)
    with pytest.raises(RunDirectoryBusy) as refused:
        RunLock(tmp_path)
    line = str(refused.value)
    assert line.startswith(f"{tmp_path} is in use by another job (host ") and f"pid {os.getpid()}," in line
    assert line.endswith("wait for it to end, stop it, or give this job another run.name") and "\n" not in line
    first.release()
    RunLock(tmp_path).release()


def test_a_lock_left_by_a_killed_job_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from slimish.orchestration.run_lock import RunLock\n"
                               f"RunLock({str(tmp_path)!r}); print('held', flush=True); time.sleep(600)"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryBusy, match=f"pid {holder.pid},"):
            RunLock(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = RunLock(tmp_path)  # the kernel released it with its holder; its line is replaced by ours
    assert f"pid {os.getpid()}," in (tmp_path / ".lock").read_text()
    lock.release()


def test_train_on_a_held_run_directory_exits_2_and_writes_nothing(task_assets, tmp_path):
    """`slimish train` as a user runs it (a process of its own: the CLI sets up logging for the whole process)."""
    run_dir = tmp_path / "runs" / "busy"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    lock = RunLock(run_dir)
    try:
        config = str(REPO / "configs/quickstart_cpu.yaml")
        result = subprocess.run([sys.executable, "-m", "slimish.cli", "train", config,
                                 f"model.hf_path={task_assets['model']}", f"data.path={task_assets['train']}",
                                 f"run.output_dir={tmp_path / 'runs'}", "run.name=busy", "eval.every=0",
                                 "sft.steps=0"], cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        lock.release()
    err = result.stderr
    assert result.returncode == 2, err[-3000:]
    assert err.startswith("error: ") and "is in use by another job" in err and err.count("\n") == 1, err[-3000:]
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "metrics.jsonl"]
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
