"""The job's log: one format for the driver and every Ray actor, at `run.log_level`.

`setup(level)` gives the "slimish" logger one handler, on stderr, in the format below; the CLI calls it for a job,
and Ray calls `setup_worker` in every worker process it starts for the job (the job's runtime_env names it as
`worker_process_setup_hook`, with the level in SLIMISH_LOG_LEVEL), so an actor's warning reads like the driver's,
behind the prefix Ray adds to an actor's output. Library code logs through `logging.getLogger(__name__)`; only the
CLI prints (its own output, and the job's step lines, which it is given to print).
"""

from __future__ import annotations

import logging
import os
import sys

LEVEL_ENV = "SLIMISH_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (pytest and Ray replace it), not the one at setup."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ assigns one: ignored
        pass


def setup(level: str = "info") -> None:
    """Log the "slimish" logger's records at `level` and above to stderr, in FORMAT; idempotent."""
    logger = logging.getLogger("slimish")
    logger.setLevel(level.upper())
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        logger.addHandler(handler)


def setup_worker() -> None:
    """Ray's worker_process_setup_hook: `setup` at the job's level."""
    setup(os.environ.get(LEVEL_ENV, "info"))
