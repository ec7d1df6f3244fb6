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
import warnings

LEVEL_ENV = "SLIMISH_LOG_LEVEL"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (pytest and Ray replace it), not the one at setup."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ assigns one: ignored
        pass


# Third-party warnings that tell a slimish user nothing to act on, each with why. They come once per process that
# imports the library, so a job printed some twenty of them before its first step.
IGNORED_WARNINGS = (
    # Megatron-Core, at import: slimish builds its model from the local spec and names its norms; it uses neither
    # Transformer Engine nor apex (docs/gpu.md), so their absence changes nothing.
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed\. Falling back to Torch Norm",
    # Megatron-Core's own TransformerConfig default, not a setting of ours (slimish captures no CUDA graphs).
    r"full scope is deprecated",
)
QUIET_LOGGERS = {
    # torch, at import on a machine without a CUDA runtime (the CPU tier): nothing here compiles CUDA extensions.
    "torch.utils.cpp_extension": logging.ERROR,
}


class _DropMessage(logging.Filter):
    def __init__(self, fragment: str):
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def quiet_third_party() -> None:
    """Drop the third-party warnings above; idempotent. Everything else third-party code says still shows."""
    for message in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    # Ray, starting the job's own loopback cluster: token authentication is what slimish wants (launch/train.sbatch
    # sets it explicitly on a real cluster), not news.
    auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropMessage) for f in auth.filters):
        auth.addFilter(_DropMessage("Token authentication is enabled for this Ray cluster"))


def setup(level: str = "info") -> None:
    """Log the "slimish" logger's records at `level` and above to stderr, in FORMAT, and `quiet_third_party()`;
    idempotent."""
    quiet_third_party()
    logger = logging.getLogger("slimish")
    logger.setLevel(level.upper())
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        logger.addHandler(handler)


def setup_worker() -> None:
    """Ray's worker_process_setup_hook: `setup` at the job's level."""
    setup(os.environ.get(LEVEL_ENV, "info"))
