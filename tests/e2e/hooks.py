"""Fault injection for the e2e tests, through hooks the job calls (named in the config by dotted path)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

TRIGGER = "kill_between_buckets"  # created by the test in the run directory to arm the hook
DONE = "killed_between_buckets"   # written by the hook: the weight version whose sync it interrupted


def kill_engine_between_buckets(version: str, bucket: int, engine_urls: list[str]) -> None:
    """`weight_sync.after_bucket_hook`: once armed (the file TRIGGER in the run directory named by the environment
    variable SLIMISH_TEST_RUN_DIR), SIGKILL engine 0's process group right after bucket 1 of a sync is on its way,
    so the kill lands between two buckets by construction. Engine 0's PID is the one in pids.json: the test never
    restarts engine 0 before this."""
    run_dir = Path(os.environ["SLIMISH_TEST_RUN_DIR"])
    trigger = run_dir / TRIGGER
    if bucket != 1 or not trigger.exists():
        return
    engine0 = json.loads((run_dir / "placement.json").read_text())["engines"][0]["url"]
    if engine0 not in engine_urls:
        return
    trigger.unlink()
    os.killpg(json.loads((run_dir / "pids.json").read_text())["servers"][0], signal.SIGKILL)
    (run_dir / DONE).write_text(version)
