"""Fault injection for the e2e tests, through hooks the job calls (named in the config by dotted path)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

TRIGGER = "fault_between_buckets"  # {"engine": i, "signal": "SIGKILL" | "SIGSTOP"}: the test writes it to arm the hook
DONE = "faults_between_buckets.jsonl"  # the hook appends {"version", "engine", "signal"} for each fault it made


def arm_fault_between_buckets(run_dir: Path, *, engine: int, signal_name: str) -> None:
    (run_dir / TRIGGER).write_text(json.dumps({"engine": engine, "signal": signal_name}))


def faults_made(run_dir: Path) -> list[dict]:
    path = run_dir / DONE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def listening_pid(url: str) -> int:
    """The PID of the process listening on `url`'s port (a restarted engine's server: pids.json has the first)."""
    import psutil

    port = int(url.rsplit(":", 1)[1])
    return next(c.pid for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid)


def fault_between_buckets(version: str, bucket: int, engine_urls: list[str]) -> None:
    """`weight_sync.after_bucket_hook`: once armed (the file TRIGGER in the run directory named by the environment
    variable SLIMISH_TEST_RUN_DIR), send the armed signal to the armed engine's process group right after bucket 1
    of a sync is on its way, so the fault lands between two buckets by construction: SIGKILL (the engine dies) or
    SIGSTOP (it hangs)."""
    run_dir = Path(os.environ["SLIMISH_TEST_RUN_DIR"])
    trigger = run_dir / TRIGGER
    if bucket != 1 or not trigger.exists():
        return
    armed = json.loads(trigger.read_text())
    url = json.loads((run_dir / "placement.json").read_text())["engines"][armed["engine"]]["url"]
    if url not in engine_urls:
        return
    trigger.unlink()
    os.killpg(os.getpgid(listening_pid(url)), getattr(signal, armed["signal"]))
    with (run_dir / DONE).open("a") as f:
        f.write(json.dumps({"version": int(version), **armed}) + "\n")
