"""Two jobs on one host at once, then one of them with its driver SIGKILLed.

Two quickstart jobs start together (each its own local Ray), with every port left at its default (0: a free one
picked at the start), so they never collide: each ends with all its steps, its engines and router on ports of
their own. One runs 3 steps; the other runs on until the first is done and it has trained 2 steps, then its driver
is SIGKILLed (no shutdown() runs): what the job started goes with it. Its engines (with every SGLang process), its
router, its reward workers, its trainer and rollout actors and Ray's raylet and GCS are gone within seconds:
engines and reward workers by PR_SET_PDEATHSIG on the actor that started them, the actors with the raylet, the
raylet and GCS with the driver (measured here: all within 3 s; waited for up to 30 s). Two of Ray's own agents
(the dashboard and runtime-env agents of the local Ray) wait out Ray's reconnection timeout to the dead GCS and
exit about 60 s later; the test waits up to 120 s for them, so that nothing at all is left. docs/running.md
states both bounds."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import psutil

from tests.e2e.procs import Reaper, become_subreaper, leftovers, train_command


def _metrics(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _ports(run_dir) -> set[int]:
    placement = json.loads((run_dir / "placement.json").read_text())
    return {int(entry["url"].rsplit(":", 1)[1]) for entry in placement["engines"] + [placement["router"]]}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_two_jobs_side_by_side_and_a_sigkilled_driver_leaves_nothing(task_assets, tmp_path):
    become_subreaper()
    short_log, long_log = tmp_path / "short.log", tmp_path / "long.log"
    short = subprocess.Popen(train_command(task_assets, tmp_path, "run.name=short", "rl.num_steps=3", "sft.steps=3"),
                             stdout=short_log.open("w"), stderr=subprocess.STDOUT, cwd=tmp_path)
    long = subprocess.Popen(train_command(task_assets, tmp_path, "run.name=long", "rl.num_steps=1000", "sft.steps=3"),
                            stdout=long_log.open("w"), stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        assert short.wait(timeout=900) == 0, short_log.read_text()[-4000:]
        deadline = time.monotonic() + 900
        while len(_metrics(tmp_path / "long")) < 2:
            assert long.poll() is None, long_log.read_text()[-4000:]
            assert time.monotonic() < deadline, long_log.read_text()[-4000:]
            time.sleep(1)
        servers = json.loads((tmp_path / "long" / "pids.json").read_text())["servers"]
        actors = [p.pid for p in psutil.Process(long.pid).children(recursive=True)
                  if p.name().startswith("ray::") and "Agent" not in p.name()]
        workers = [p.pid for p in psutil.Process(long.pid).children(recursive=True)
                   if "slimish.rollout.reward_workers" in " ".join(p.cmdline())]
    finally:
        long.send_signal(signal.SIGKILL)
        long.wait(timeout=60)
    assert [r["step"] for r in _metrics(tmp_path / "short")] == [1, 2, 3]
    assert not _ports(tmp_path / "short") & _ports(tmp_path / "long"), "each job on ports of its own"
    assert len(servers) == 3 and len(workers) == 2 and actors, (servers, workers, actors)
    with Reaper():  # the killed driver's orphans come to this process (a subreaper): reap them as init would
        deadline = time.monotonic() + 30
        while any(map(_alive, servers + workers + actors)) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [pid for pid in servers + workers + actors if _alive(pid)]
        assert not left, [" ".join(psutil.Process(pid).cmdline())[:100] for pid in left]
        assert not leftovers(wait_s=120), "Ray's agents outlived the SIGKILLed driver by more than 120 s"
