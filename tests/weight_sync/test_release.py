"""The bounded waits of a weight-sync sender (`slimish.weight_sync.transport`), with the engines' answers as plain
futures (the stand-in at the HTTP boundary; tests/e2e/test_sync_faults.py runs the same waits against real engines
and tests/weight_sync/test_broadcast_release.py against a real gloo collective): released from another thread,
or past a deadline, a wait raises `SyncReleased` naming the engines that had not answered; a failed answer raises
its own error; progress is counted only when every engine answered well; a release between syncs is ignored."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from slimish.weight_sync.sender import sync_to
from slimish.weight_sync.tensor import TensorTransport
from slimish.weight_sync.transport import SyncReleased

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def new_sync():
    return sync_to(URLS, transport="tensor", group_name="t", bucket_bytes=1 << 20, master_port=1, bucket_timeout_s=2.0,
                   min_bandwidth_mib_s=1.0)


@pytest.fixture
def transport():
    sender = new_sync()
    sender.connect()
    yield sender.transport
    sender.close()


def answered(value=None, error: Exception | None = None) -> Future:
    future = Future()
    future.set_exception(error) if error else future.set_result(value)
    return future


def test_a_release_during_the_wait_raises_naming_who_had_not_answered(transport):
    calls = [answered({"success": True}), Future()]
    progress = transport.progress_at
    first = True

    def release_at_the_first_slice(timeout: float) -> bool:  # in the wait, deterministically
        nonlocal first
        if first:
            transport.release("engine 2 froze")
            first = False
        return False

    with pytest.raises(SyncReleased) as failure:
        transport.wait_until(release_at_the_first_slice, deadline=time.monotonic() + 60, what="a bucket")
    assert "engine 2 froze" in str(failure.value) and not failure.value.by_deadline
    with pytest.raises(SyncReleased) as failure:  # released stays released: every later wait ends too
        transport.results(calls, deadline=time.monotonic() + 60, what="a bucket")
    assert failure.value.unanswered == [URLS[1]]
    assert transport.progress_at == progress


def test_a_bucket_past_its_deadline_raises_naming_who_had_not_answered(transport):
    assert transport.deadline(3 << 20) - time.monotonic() == pytest.approx(2.0 + 3.0, abs=0.5)
    with pytest.raises(SyncReleased) as failure:
        transport.results([Future(), answered()], deadline=time.monotonic(), what="a bucket")
    assert failure.value.by_deadline and failure.value.unanswered == [URLS[0]]
    assert "weight_sync.bucket_timeout_s" in str(failure.value)


def test_a_failed_answer_raises_its_own_error_and_is_no_progress(transport):
    progress = transport.progress_at
    with pytest.raises(ConnectionError):
        transport.results([answered(), answered(error=ConnectionError("reset"))], deadline=time.monotonic() + 60,
                          what="a bucket")
    assert transport.progress_at == progress
    assert transport.results([answered(1), answered(2)], deadline=time.monotonic() + 60, what="a bucket") == [1, 2]
    assert transport.progress_at > progress


def test_a_release_between_syncs_is_ignored():
    sender = new_sync()
    sender.connect()
    try:
        sender.release("an engine died after the sync ended")
        assert not sender.transport.released
    finally:
        sender.close()


def test_every_transport_starts_unreleased():
    assert not TensorTransport(new_sync().transport.context).released


def test_the_in_flight_hook_sees_each_bucket_once_asked_for_counting_from_0_per_sync(transport):
    """`weight_sync.in_flight_hook`'s moment: called from `loading` (the engines have been asked for the bucket, whose
    answers are the futures), before the transport sends it; the index starts over with each sync."""
    seen = []
    transport.in_flight = seen.append
    for _ in range(2):
        transport.loading([answered(), answered()], deadline=time.monotonic() + 60)
        transport.wait_loaded()
    transport.start_sync()
    transport.loading([answered(), answered()], deadline=time.monotonic() + 60)
    assert seen == [0, 1, 0]
