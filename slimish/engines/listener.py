"""Who listens on a port: a job checks that the process answering on an engine's or the router's port is the one it
started before it sends that port its key.

Without the check, anyone on the host who binds the port first (another job's engine, a local user's listener)
answers the readiness probe, and the job then sends it the key with every call. The listening socket's owner is
found the way `ss -p` finds it: the socket's inode in /proc/net/tcp{,6} (state LISTEN), then the process holding an
fd to that inode among the started process and its descendants (SGLang's server is a process tree). Both files
show the reading process's network namespace, which is the one the started process listens in (it is a child).
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from slimish.errors import UserError

_LISTEN = "0A"  # TCP state in /proc/net/tcp


class ForeignListener(UserError):
    """A port the job started a server on is held by a process the job did not start."""


def listening_inodes(port: int) -> set[int]:
    """The inodes of the sockets listening on TCP `port` (any address, IPv4 or IPv6) in this network namespace."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == _LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                found.add(inode)
    return found


def socket_inodes(pid: int) -> set[int]:
    """The socket inodes process `pid` holds open (empty if it is gone)."""
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants."""
    try:
        root = psutil.Process(pid)
        return [pid] + [child.pid for child in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def holder(inode: int) -> str:
    """The process that holds socket `inode`, for the error message ("pid 123 (python -m http.server)"), as far as
    this user may see."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if inode in socket_inodes(proc.info["pid"]):
            return f"pid {proc.info['pid']} ({' '.join(proc.info['cmdline'] or [])[:80]})"
    return "a process this user cannot see"


def check_listener(port: int, *, owner_pid: int, what: str, key: str) -> bool:
    """Whether the process tree of `owner_pid` listens on `port` now (False: nobody listens yet). Raises
    `ForeignListener` (one line naming the holder and config `key`) if anyone else does."""
    listening = listening_inodes(port)
    if not listening:
        return False
    ours = set().union(*(socket_inodes(pid) for pid in process_tree(owner_pid)))
    foreign = listening - ours
    if foreign:
        raise ForeignListener(f"port {port}, where this job started {what}, is held by {holder(min(foreign))}, not "
                              f"by the process the job started; the job's key is not sent there. Stop that process, "
                              f"or set {key} to a free port (0 picks one)")
    return True
