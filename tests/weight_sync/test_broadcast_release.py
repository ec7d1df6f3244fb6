"""A broadcast that cannot complete (one receiver frozen, or killed while the send to it was blocked) lets the
sender go, on a real gloo group of three processes (tests/weight_sync/broadcast_world.py): released from another
thread (what the driver does once the watchdog has seen the engine die or freeze), or by the bucket's deadline; the
group is then given up at once, and the other receiver has its bucket. Before, the sender sat inside the collective
for the group's 10-minute timeout. tests/gpu/test_nccl_release.py runs the same world on NCCL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port

WORLD = Path(__file__).with_name("broadcast_world.py")


def run_world(scenario: str, *, backend: str = "gloo", world: int = 3) -> tuple[dict, list[str]]:
    """(the sender's report, the output of every receiver but the faulty last one)."""
    port = free_port()
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    receivers = [subprocess.Popen([sys.executable, str(WORLD), "receiver", str(rank), str(port), backend,
                                   str(world)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(1, world)]
    try:
        sender = subprocess.run([sys.executable, str(WORLD), "sender", str(port), scenario, str(receivers[-1].pid),
                                 backend, str(world)], env=env, capture_output=True, text=True, timeout=300)
        assert sender.returncode == 0, sender.stdout + sender.stderr
        report = json.loads(sender.stdout.strip().splitlines()[-1])
    finally:
        for proc in receivers:
            proc.kill()
    outputs = [proc.communicate(timeout=60)[0] for proc in receivers]
    return report, outputs[:-1]


@pytest.mark.parametrize("scenario", ["frozen", "killed"])
def test_a_release_lets_a_blocked_broadcast_go(scenario):
    report, survivors = run_world(scenario)
    raised = report["raised"]
    assert raised is not None, "the broadcast to a frozen receiver completed"
    if raised["type"] == "SyncReleased":
        assert "receiver froze" in raised["message"] and raised["stalled_s"] > 0
    else:  # killed before the send to it had blocked: gloo fails the send itself
        assert scenario == "killed" and "Connection" in raised["message"], raised
    assert report["aborted"]
    assert all("got 7" in out for out in survivors), survivors


def test_a_bucket_past_its_deadline_is_given_up():
    report, survivors = run_world("deadline")
    assert report["raised"]["type"] == "SyncReleased", report
    assert "deadline" in report["raised"]["message"] and "weight_sync.bucket_timeout_s" in report["raised"]["message"]
    assert all("got 7" in out for out in survivors), survivors
