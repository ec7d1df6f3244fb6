"""One job per run directory: `RUN_DIR/.lock`, held (flock) from the moment a job opens its run directory until it
ends. A second job on the same directory (the same `run.name`, on this host or another that shares the filesystem)
refuses at once with one line naming the holder, before it writes anything there: it would otherwise replace the
first one's config and job key, truncate its metrics and prune its checkpoints. The kernel releases the lock when
its holder exits however it exits, so a lock left by a killed job is never in the way (the file stays, with the
dead holder's line, and is taken over)."""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from slimish.errors import UserError

LOCK_FILE = ".lock"


class RunDirectoryBusy(UserError):
    """Another live job holds the run directory."""


class RunLock:
    """The lock of `run_dir` for this process; `release()` (or the process's exit) gives it up."""

    def __init__(self, run_dir: Path):
        path = Path(run_dir) / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = path.read_text(errors="replace").strip() or "a process that has not said who it is yet"
            os.close(fd)
            raise RunDirectoryBusy(f"{run_dir} is in use by another job ({holder}): wait for it to end, stop it, or "
                                   "give this job another run.name") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n".encode())
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
