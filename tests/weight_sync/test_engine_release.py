"""The engine side of the sharded broadcast is bounded (`slimish.weight_sync.engine_loader.receive_shard`), on real
gloo groups: an engine rank (a spawned process running the real `receive_shard`, as SGLang's TP worker does inside
`update_weights_from_tensor`) and a sender (this process, slimish's own group helper, as `join_rank_groups`).
A sender that never comes, one that joins and never sends, and one that joins and gives up (destroys its side) each
leave the engine rank with one error, its group aborted and forgotten; a later connection's receive then delivers.
And the sender's side: a release ends a sender's join of its per-rank groups at once (rank 0's and an expert
owner's), and the engine rank that comes late is let go. Ordered by the pipe and by hooks, not by sleeps: the sender
acts only on what the engine rank reports. 18-31 s for the file (most of it the spawned process's imports, SGLang's
among them; the silent sender costs its 1 s deadline, the absent one its 1 s rendezvous bound)."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from datetime import timedelta

import pytest
import torch

from slimish.weight_sync.process_group import destroy_group, new_weight_update_group
from tests.conftest import free_port

PART = torch.arange(4, dtype=torch.float32, device="cpu")


class Params:
    """What `receive_shard` loads into: one parameter `w` of PART's shape, on `device`."""

    def __init__(self, device: str = "cpu"):
        self.params = {"w": torch.nn.Parameter(torch.zeros(4, device=device), requires_grad=False)}

    def named_parameters(self):
        return iter(self.params.items())

    def parameters(self):
        return iter(self.params.values())


def engine_rank(conn, device: str = "cpu") -> None:
    """Run `receive_shard` on each spec sent, into parameters on `device`; answer (status, what it loaded or its
    error, the groups it keeps). On a GPU, a failed receive is followed by `torch.cuda.synchronize()`: it returns
    once no kernel of the aborted group holds the stream."""
    from slimish.weight_sync import engine_loader

    if device != "cpu":
        torch.cuda.set_device(device)
    while (spec := conn.recv()) is not None:
        model = Params(device)
        try:
            engine_loader.receive_shard(model, [(spec, torch.zeros(1, device="cpu"))])
            conn.send(("ok", model.params["w"].data.cpu(), sorted(engine_loader._GROUPS)))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            if device != "cpu":
                torch.cuda.synchronize()
            conn.send(("error", f"{type(exc).__name__}: {exc}", sorted(engine_loader._GROUPS)))


def spec(name: str, port: int, timeout_s: float, backend: str = "gloo") -> str:
    """The `receive_shard` entry of PART over group `name` (the sender at rank 0 on `port`), as `shard_payloads`
    makes it."""
    return json.dumps(dict(group=name, connection=name, address="127.0.0.1", port=port, world_size=2, rank=1,
                           backend=backend, names=["w"], dtypes=["float32"], shapes=[[4]], offsets=[0],
                           nbytes=PART.numel() * PART.element_size(), timeout_s=timeout_s))


def join(name: str, port: int, backend: str = "gloo"):
    return new_weight_update_group(backend=backend, master_address="127.0.0.1", master_port=port, world_size=2, rank=0,
                                   group_name=name, join_timeout=timedelta(seconds=30))


def start_engine(device: str = "cpu"):
    """An engine rank process running `engine_rank` on `device`: yields its end of the pipe, stops it after."""
    parent, child = multiprocessing.get_context("spawn").Pipe()
    proc = multiprocessing.get_context("spawn").Process(target=engine_rank, args=(child, device), daemon=True)
    proc.start()
    yield parent
    parent.send(None)
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()


@pytest.fixture(scope="module")
def engine():
    yield from start_engine()


def deliver(engine, name: str, backend: str = "gloo", device: str = "cpu") -> None:
    """A connection whose sender (on `device`) sends: the engine rank loads PART."""
    port = free_port()
    engine.send(spec(name, port, timeout_s=30.0, backend=backend))
    group = join(name, port, backend)
    torch.distributed.broadcast(PART.view(torch.uint8).to(device), src=0, group=group)
    status, loaded, groups = engine.recv()
    assert status == "ok", loaded
    assert torch.equal(loaded, PART) and groups == [name]
    destroy_group(group)


@pytest.mark.parametrize("sender", ["silent", "gives-up", "absent"])
def test_a_receive_whose_sender_fails_it_ends_and_the_next_connection_delivers(engine, sender):
    """silent: the sender joins and never sends; the engine rank gives up at the bucket's deadline (1 s) with an error
    naming it. gives-up: the sender destroys its side (as `abort` does; a sender process that dies closes the same
    connections), which ends the receive at once. absent: no sender comes; the rendezvous fails within the deadline.
    In each case the group is forgotten, and the next connection's receive delivers."""
    name, port = f"engine_release_{sender}", free_port()
    engine.send(spec(name, port, timeout_s=1.0))
    if sender != "absent":
        group = join(name, port)
        if sender == "gives-up":
            destroy_group(group)
            del group  # a gloo group closes its connections with its last reference
    status, error, groups = engine.recv()
    assert status == "error" and groups == [], error
    if sender == "silent":
        assert f"group {name}" in error and "did not arrive within 1.0 s" in error, error
        assert "weight_sync.bucket_timeout_s" in error
        destroy_group(group)
    deliver(engine, f"engine_release_{sender}_next")


@pytest.mark.parametrize("sender", ["rank0", "owner"])
def test_a_release_ends_the_senders_join_and_a_late_engine_is_let_go(engine, monkeypatch, sender):
    """A sender inside `join_rank_groups`' rendezvous (rank 0's `BroadcastTransport`, an expert owner's
    `OwnerGroups`), the engine rank not come (it died, or froze before joining), is released from another thread
    (`WeightSender.release`, the watchdog's): the join raises at once, not at its 60 s timeout. The release is made
    once the rendezvous has started (a hook on the group helper), not after a sleep. The engine rank, coming late,
    completes the abandoned rendezvous, whose group is then destroyed: its receive fails (at once, or at its
    deadline) and forgets the group, and the next connection delivers."""
    from slimish.weight_sync import broadcast
    from slimish.weight_sync.broadcast import BroadcastTransport
    from slimish.weight_sync.owners import OwnerGroups
    from slimish.weight_sync.sender import local_context
    from slimish.weight_sync.transport import SyncReleased

    entered, real = threading.Event(), broadcast.new_weight_update_group

    def joining(**kwargs):
        entered.set()
        return real(**kwargs)

    monkeypatch.setattr(broadcast, "new_weight_update_group", joining)
    context = local_context(f"join_release_{sender}", bucket_timeout_s=60.0)
    port = free_port()
    if sender == "rank0":
        side = BroadcastTransport(context)
        side.clients, side._ports = [None], [port]
        side.start_sync()
        join, raised = (lambda: side._join_rank_groups(1, timeout=timedelta(seconds=60),
                                                       deadline=time.monotonic() + 60)), SyncReleased
        name = f"{context.group_name}_rank0"
    else:
        side = OwnerGroups(context, rank=1, engines=1, bucket_bytes=PART.numel() * PART.element_size())
        side.ports = [port]
        join, raised = (lambda: side.send([(PART.view(torch.uint8).clone(), [0])])), RuntimeError
        name = side.name.format(rank=0)
    releaser = threading.Thread(target=lambda: (entered.wait(), side.release("engine 1 froze")))
    releaser.start()
    with pytest.raises(raised, match="engine 1 froze"):
        join()
    releaser.join()
    engine.send(spec(name, port, timeout_s=2.0))  # the engine rank comes late
    status, error, groups = engine.recv()
    assert status == "error" and groups == [], error
    deliver(engine, f"join_release_{sender}_next")


class NeverDone:
    """A broadcast's Work that never completes: an NCCL kernel waiting for a sender that froze."""

    def is_completed(self) -> bool:
        return False

    def wait(self):
        raise AssertionError("waited on a work that never completes")


def test_an_nccl_receive_past_its_deadline_aborts_its_communicator(monkeypatch):
    """What surrounds the NCCL abort, which cannot run here (no GPU; tests/gpu/test_nccl_engine_release.py runs it
    on two): an NCCL group's receive still pending at the deadline is aborted with torch's `_abort_process_group`
    (not destroyed: a destroy would wait on the kernel), forgotten, kept referenced while its work is pending, and
    the request fails naming the group. The group, the work and the abort are stand-ins; the deadline is 1 ms (the
    work never completes, so the poll reaches it whatever the timing)."""
    from slimish import collectives
    from slimish.weight_sync import engine_loader

    group, work, aborted, timeouts = object(), NeverDone(), [], []
    monkeypatch.setattr(engine_loader, "_GROUPS", {})
    monkeypatch.setattr(engine_loader, "_GIVEN_UP", [])
    monkeypatch.setattr(engine_loader, "_join", lambda spec: engine_loader._GROUPS.setdefault(
        spec["group"], (spec["connection"], group))[1])
    monkeypatch.setattr(collectives, "broadcast", lambda tensor, *, src, group, async_op: work)
    monkeypatch.setattr(torch.distributed, "set_timeout", lambda timeout, group: timeouts.append(timeout))
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_abort_process_group", aborted.append)
    monkeypatch.setattr(torch.distributed, "destroy_process_group",
                        lambda group: pytest.fail("an NCCL group with a kernel in flight is aborted, not destroyed"))
    entry = json.loads(spec("nccl_group", 1, timeout_s=0.001))
    with pytest.raises(TimeoutError, match="group nccl_group: the sender's broadcast of 16 bytes did not arrive"):
        engine_loader.receive_shard(Params(), [(json.dumps({**entry, "backend": "nccl"}), None)])
    assert aborted == [group] and engine_loader._GROUPS == {} and engine_loader._GIVEN_UP == [(work, group)]
    assert timeouts == [timedelta(seconds=0.002)]  # twice the deadline: the group's own timeout never fires first


@pytest.mark.parametrize("sender", ["rank0", "owner"])
def test_a_senders_nccl_groups_are_aborted_when_it_gives_up(monkeypatch, sender):
    """The sender's side on NCCL (cannot run here): a given-up sharded broadcast aborts each per-rank communicator
    (`abort_group`: torch's `_abort_process_group`), rank 0's (`BroadcastTransport.abort`) and an owner's
    (`OwnerGroups.abort`); the engine ranks abort theirs at their deadline. Groups and abort are stand-ins."""
    from slimish.weight_sync.broadcast import BroadcastTransport
    from slimish.weight_sync.owners import OwnerGroups
    from slimish.weight_sync.sender import local_context

    aborted, groups = [], [object(), object()]
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_abort_process_group", aborted.append)
    monkeypatch.setattr(torch.distributed, "destroy_process_group",
                        lambda group: pytest.fail("an NCCL group with a kernel in flight is aborted, not destroyed"))
    context = local_context(f"nccl_abort_{sender}")
    context = type(context)(**{**context.__dict__, "backend": "nccl"})
    if sender == "rank0":
        side = BroadcastTransport(context)
        side.sharded = True  # set by the sync before connect: no full-model group
        side.connect([])
        side.rank_groups = list(groups)
        side.abort()
    else:
        side = OwnerGroups(context, rank=1, engines=1, bucket_bytes=16)
        side.groups = list(groups)
        side.abort()
    assert aborted == groups
