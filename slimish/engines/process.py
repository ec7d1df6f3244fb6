"""Start and stop the server processes we own (SGLang engines, sglang-router), by PID, leaving nothing behind.

Each server starts in its own session (process group) with a parent-death signal, so that it dies with the
process that started it even if that one is killed hard; `stop()` signals the whole group it created.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from slimish.engines import timeouts
from slimish.engines.listener import check_listener

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ManagedProcess:
    """A server process group started by us, with its log file."""

    def __init__(self, name: str, argv: list[str], *, env: dict, log_path: Path):
        self.name, self.argv, self.env, self.log_path = name, argv, env, Path(log_path)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        log.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stopped(self) -> list[int]:
        """The processes of its group that are stopped (state T in /proc/<pid>/stat: SIGSTOP, or a terminal's stop
        signal): they run nothing until continued, however long the server's own timeouts are."""
        if self.proc is None:
            return []
        return [pid for pid, state in _group_states(self.proc.pid).items() if state == "T"]

    def commands(self) -> list[str]:
        """The command names (/proc/<pid>/comm) of its group's live processes now, sorted: what the server is running
        (a kernel compiler started by a JIT, say)."""
        if self.proc is None:
            return []
        return sorted(name for pid, state in _group_states(self.proc.pid).items()
                      if state != "Z" and (name := _command(pid)))

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def raise_if_exited(self) -> None:
        """A RuntimeError (with the log tail) if the process exited."""
        if not self.alive():
            raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before becoming ready; "
                               f"log {self.log_path}:\n{self.log_tail()}")

    def listening(self, port: int, *, key: str) -> bool:
        """Whether this process (or a child of it) listens on `port` now; `ForeignListener` if another process does
        (`slimish.engines.listener`), whether or not this one is still running (one that found the port taken
        exits); a RuntimeError if this one exited."""
        if check_listener(port, owner_pid=self.proc.pid, what=self.name, key=key):
            return True
        self.raise_if_exited()
        return False

    def http_ok(self, url: str) -> bool:
        """Whether GET `url` answers 200 now; a RuntimeError (with the log tail) if the process exited."""
        self.raise_if_exited()
        try:
            return httpx.get(url, timeout=timeouts.HTTP_READY_POLL_S).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_http_ok(self, url: str, timeout_s: float, interval_s: float = 1.0, *,
                     own_port: tuple[int, str] | None = None) -> None:
        """Poll GET `url` until it answers 200; fail early (with the log tail) if the process died. `own_port`
        (port, config key): GET only once this process listens there, `ForeignListener` if another one does."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (own_port is None or self.listening(own_port[0], key=own_port[1])) and self.http_ok(url):
                return
            time.sleep(interval_s)
        raise TimeoutError(f"{self.name} not ready at {url} after {timeout_s:.0f}s; log {self.log_path}:\n"
                           f"{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group we created, then SIGKILL what is left; reap the leader."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(pgid):
                self.proc.poll()
                time.sleep(0.1)
            if not _group_alive(pgid):
                break
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _group_alive(pgid: int) -> bool:
    """True while any non-zombie process of group `pgid` exists."""
    return any(state != "Z" for state in _group_states(pgid).values())


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:  # it exited meanwhile
        return ""


def _group_states(pgid: int) -> dict[int, str]:
    """{pid: state letter of /proc/<pid>/stat} of every process in group `pgid` now."""
    states = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid:
            states[int(entry)] = fields[0]
    return states
