"""The engine side of the sharded broadcast on NCCL, on two GPUs (skipped with fewer): an engine rank on GPU 1 (a
spawned process running the real `engine_loader.receive_shard`) receives one bucket from a sender on GPU 0, then
waits for a second that the sender never sends (it froze): the receive's kernel waits on the engine's stream until
the bucket's deadline (2 s), when the engine rank aborts its communicator with torch's `_abort_process_group`; the
request fails naming the group, `torch.cuda.synchronize()` returns on the engine (no kernel holds its stream), and
the next connection delivers. tests/weight_sync/test_engine_release.py runs the same on gloo, and what surrounds
this abort with stand-ins. Not yet run: the lent GPU machines have had one GPU."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import free_port
from tests.weight_sync.test_engine_release import PART, deliver, join, spec, start_engine

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.fixture
def engine():
    yield from start_engine("cuda:1")


def test_an_engine_ranks_nccl_receive_is_aborted_at_its_deadline_and_the_next_connection_delivers(engine):
    from slimish.weight_sync.process_group import abort_group

    torch.cuda.set_device(0)
    name, port = "nccl_engine_release", free_port()
    engine.send(spec(name, port, timeout_s=30.0, backend="nccl"))
    group = join(name, port, "nccl")
    torch.distributed.broadcast(PART.view(torch.uint8).to("cuda:0"), src=0, group=group)  # the communicator is up
    status, loaded, groups = engine.recv()
    assert status == "ok" and torch.equal(loaded, PART) and groups == [name], loaded
    engine.send(spec(name, port, timeout_s=2.0, backend="nccl"))  # the next bucket of the connection: never sent
    status, error, groups = engine.recv()  # answered after the engine's synchronize
    assert status == "error" and "did not arrive within 2.0 s" in error and groups == [], error
    abort_group(group, "nccl")
    deliver(engine, f"{name}_next", backend="nccl", device="cuda:0")
