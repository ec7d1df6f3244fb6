"""Checkpoint files written in the background while training goes on (checkpoint.async_save): Megatron-Core's async
dist checkpointing, one queue per trainer process.

`dist_checkpointing.save(..., async_sharded_save=True)` plans the save (collectives on every rank) and returns a
request; scheduling it stages what this rank writes (device tensors copied to host memory, host tensors that are
views of a larger buffer cloned) and forks a process that writes the files from that snapshot (Megatron's
TemporalAsyncCaller), so the step that follows may change the weights and the Adam state at once. `finish` waits for
every rank's writer and runs the request's finalisation (rank 0 writes metadata.json, which makes the directory a
dist checkpoint), on every rank together: it is a collective, called by all trainer ranks. Until it returns the
directory is incomplete; the driver commits a run checkpoint only after it (`slimish.orchestration.checkpoints`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Called in the writer process before it writes anything: tests hold a write there so that it provably overlaps the
# next step (the writer is a fork: set it before the save).
before_write: Callable[[], None] | None = None


def _gated(write: Callable, *args, **kwargs):
    if before_write is not None:
        before_write()
    return write(*args, **kwargs)


class BackgroundWrites:
    """The checkpoint writes this trainer process has started and not finished."""

    def __init__(self) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self._queue = AsyncCallsQueue(persistent=False)  # a forked writer per save: nothing left between saves

    def schedule(self, request) -> None:
        """Start writing `request` (an AsyncRequest from dist_checkpointing.save); returns once it is staged."""
        if request.async_fn is not None:
            request = request._replace(async_fn=functools.partial(_gated, request.async_fn))
        self._queue.schedule_async_request(request)

    @property
    def pending(self) -> int:
        return self._queue.get_num_unfinalized_calls()

    def finish(self) -> int:
        """Wait for every started write on every rank and finalise them (collective: all trainer ranks call it);
        returns how many were finished. A rank's failed write raises here, on every rank."""
        return len(self._queue.maybe_finalize_async_calls(blocking=True))

    def abort(self) -> None:
        """Stop the writers without finalising (the job is going down; the checkpoint stays uncommitted)."""
        for call in list(self._queue.async_calls):
            call.async_caller.close(abort=True)
        self._queue.async_calls.clear()
