"""A weight-update group of one sender and its receivers, each a process of its own, for
tests/weight_sync/test_broadcast_release.py (gloo, three processes) and tests/gpu/test_nccl_release.py (NCCL, two
GPUs): engine stand-ins at the receiving end, since what is under test is the sender's side of a real collective.

    python broadcast_world.py receiver RANK PORT [BACKEND WORLD]      joins, receives one bucket, prints
                                                                      "got <first byte>"
    python broadcast_world.py sender PORT SCENARIO PID [BACKEND WORLD]  runs SCENARIO against the last receiver
                                                                      (process PID), prints one JSON line: what
                                                                      `wire` raised, and that `abort` returned
BACKEND is gloo (default, world 3) or nccl (rank r on GPU r). Scenarios (the other receivers take their part of the
bucket; the last one is the faulty engine):
  frozen     the last receiver is stopped (SIGSTOP) before the bucket is sent; the sync is released while it waits
  deadline   the same, with no release: the bucket's deadline (1 s plus 64 MiB at 32 MiB/s) gives it up
  killed     it is stopped, then killed while the send to it is blocked (the hang reproduced from a job: on gloo the
             send then may never complete), then the sync is released
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch

from slimish.weight_sync.broadcast import BroadcastTransport
from slimish.weight_sync.process_group import new_weight_update_group
from slimish.weight_sync.transport import SyncReleased, Transport, TransportContext

NBYTES = 64 << 20  # far more than loopback's socket buffers hold: a gloo send to a stopped receiver blocks


def device(backend: str, rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def join(rank: int, port: int, backend: str, world: int):
    """The group, with every pair's connection proven by a first small broadcast (a receiver stopped while its
    connections are still being made would stall the set-up, not the bucket)."""
    group = new_weight_update_group(backend=backend, master_address="127.0.0.1", master_port=port, world_size=world,
                                    rank=rank, group_name="release_test")
    torch.distributed.broadcast(torch.zeros(1, device=device(backend, rank)), src=0, group=group)
    if backend == "nccl":
        torch.cuda.synchronize()
    return group


def receiver(rank: int, port: int, backend: str, world: int) -> None:
    group = join(rank, port, backend, world)
    bucket = torch.zeros(NBYTES, dtype=torch.uint8, device=device(backend, rank))
    torch.distributed.broadcast(bucket, src=0, group=group)
    print(f"got {int(bucket[0])}", flush=True)
    time.sleep(600)  # the test stops it


def sender(port: int, scenario: str, pid: int, backend: str, world: int) -> None:
    transport = BroadcastTransport(TransportContext(
        master_addr="127.0.0.1", master_port=port, backend=backend, group_name="release_test", engine_tp=1,
        disk_dir="", bucket_timeout_s=1.0 if scenario == "deadline" else 600.0))
    Transport.connect(transport, [])  # no engines to call: only the collective is under test
    transport.group = join(0, port, backend, world)
    bucket = torch.full((NBYTES,), 7, dtype=torch.uint8, device=device(backend, 0))
    os.kill(pid, signal.SIGSTOP)
    if scenario == "killed":  # once the send to it has begun, whichever of the two comes first
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
    if scenario in ("frozen", "killed"):
        # Whether it lands before the wait or during it, the wait raises SyncReleased: no race in the outcome.
        threading.Timer(2.0, transport.release, ("receiver froze",)).start()
    transport.start_sync()
    raised = None
    try:
        transport.wire(bucket, deadline=transport.deadline(NBYTES))
    except SyncReleased as exc:
        raised = {"type": "SyncReleased", "message": str(exc), "stalled_s": exc.stalled_s}
    except RuntimeError as exc:  # gloo saw the killed receiver's connection close before the send blocked
        raised = {"type": "RuntimeError", "message": str(exc)[:300]}
    transport.abort()
    report = {"raised": raised, "aborted": True}
    if backend == "nccl":  # the given-up broadcast's kernel no longer holds the sender's stream
        torch.cuda.synchronize()
        report["synchronized"] = True
    print(json.dumps(report), flush=True)
    os._exit(0)  # a given-up gloo send stays pending on gloo's thread until the group's timeout: do not wait for it


if __name__ == "__main__":
    if sys.argv[1] == "receiver":
        backend, world = (sys.argv[4], int(sys.argv[5])) if len(sys.argv) > 5 else ("gloo", 3)
        receiver(int(sys.argv[2]), int(sys.argv[3]), backend, world)
    else:
        backend, world = (sys.argv[5], int(sys.argv[6])) if len(sys.argv) > 6 else ("gloo", 3)
        sender(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), backend, world)
