"""Where the job's listeners bind, and the job's key.

Every socket the job listens on binds the job's chosen interface (the node's Ray address: loopback on one host,
`SLIMISH_NET_IFNAME`'s address under launch/train.sbatch), never all interfaces. torch's `TCPStore` server binds all
interfaces whatever host it is given, so the stores we host (the trainer's rendezvous, the weight-sync groups'
rendezvous, each engine's internal one) are given a socket we bound ourselves (`master_listen_fd`).

Endpoints refuse strangers: each job draws two keys (`new_engine_keys`): an admin key, which the engines' weight
updates and control calls need (SGLang's `--admin-api-key`), and an API key, which generation and reads need
(SGLang's `--api-key`, the router's `--api-key`). The router holds only the API key. Clients pick the key by
endpoint (`slimish.engines.client.EngineAuth`).
"""

from __future__ import annotations

import random
import secrets
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

STORE_TIMEOUT = timedelta(minutes=10)  # a store's wait for a key another rank has not set yet
JOB_KEY_FILE = "job_key"  # in the run directory, mode 0600: for an operator's own calls to the engines


@dataclass(frozen=True)
class EngineKeys:
    """The keys an engine takes: `admin` for weight updates and control calls (SGLang's --admin-api-key: pause,
    abort, memory, weight updates and checks), `api` for generation and reads (its --api-key; the router's too).
    Engines started with one key (attached engines given a one-line key file) have both the same."""

    admin: str
    api: str

    @property
    def separate(self) -> bool:
        return self.admin != self.api


def new_engine_keys() -> EngineKeys:
    """Two fresh, independent keys: what holds the API key (the router) cannot update weights."""
    return EngineKeys(admin=new_job_key(), api=new_job_key())


def engine_keys(key: EngineKeys | str | None) -> EngineKeys | None:
    """`key` as EngineKeys: a single key serves as both."""
    if key is None or isinstance(key, EngineKeys):
        return key
    return EngineKeys(admin=key, api=key)


def read_keys(path: str) -> EngineKeys:
    """The keys in file `path`: the admin key on its first line and the API key on its second, or one key for both
    (a UserError naming the file when it holds none)."""
    from slimish.errors import UserError

    lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise UserError(f"{path} holds no key: write the engines' API key on its first line")
    return EngineKeys(admin=lines[0], api=lines[1] if len(lines) > 1 else lines[0])


def new_job_key() -> str:
    """256 random bits as hex. Not urlsafe base64: its alphabet has '-', and a key that begins with one is taken for
    an option by the engines' and the router's argument parsers ("--api-key: expected one argument")."""
    return secrets.token_hex(32)


def read_key(path: str) -> str:
    """The key in file `path` (its first line; a UserError naming the file when it is empty)."""
    from slimish.errors import UserError

    lines = Path(path).read_text().splitlines()
    if not lines or not lines[0].strip():
        raise UserError(f"{path} holds no key: write the engines' API key on its first line")
    return lines[0].strip()


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header SGLang's and the router's API-key check expects; none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def node_ip() -> str:
    """The address Ray knows this node by (what other nodes reach it at; 127.0.0.1 on a local, loopback-only Ray),
    or 127.0.0.1 outside Ray. Not `ray.util.get_node_ip_address()`: in a worker process that one guesses from the
    routing table and returns the host's outward address even when the node was started on 127.0.0.1."""
    ray = sys.modules.get("ray")  # a process that never imported Ray is not in a Ray cluster (and needs no import)
    if ray is None or not ray.is_initialized():
        return "127.0.0.1"
    me = ray.get_runtime_context().get_node_id()
    return next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == me)


def free_port() -> int:
    """A port free now on this node's address (loopback on one host): for a listener that must be named before it
    binds (a rendezvous master port). Another process may take it meanwhile; `listening_socket` avoids that race."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1" if node_ip().startswith("127.") else "", 0))
        return sock.getsockname()[1]


# Where `service_port` looks: above Ray's worker ports (10002-19999 by default) and launch/ray_node.sh's plan
# (20000-20099), below the kernel's ephemeral range (ip_local_port_range), which bind(port 0) and outgoing
# connections draw from: a port picked there could be taken by any process's next socket before the server binds it
# (an engine's scheduler took the router's that way).
SERVICE_PORTS_FROM = 20100


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def service_port(attempts: int = 200) -> int:
    """A port free now for a server that binds it later (an engine, the router): drawn at random outside the
    kernel's ephemeral range, so that no process's next socket is given it meanwhile (only one that names it could
    take it, and the listener check catches that: `slimish.engines.listener`). Falls back to `free_port` when the
    ephemeral range leaves no room below it."""
    low, high = SERVICE_PORTS_FROM, ephemeral_range()[0] - 1
    if high - low < 1000:
        return free_port()
    host = "127.0.0.1" if node_ip().startswith("127.") else ""
    rng = random.SystemRandom()
    for _ in range(attempts):
        port = rng.randint(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    return free_port()


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on `host:port` only (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock


def hosted_store(host: str, port: int = 0, *, world_size: int | None = None,
                 timeout: timedelta = STORE_TIMEOUT):
    """A torch `TCPStore` server listening on `host:port` only; returns (store, port). The store owns the socket
    and closes it when it is dropped."""
    import torch.distributed as dist

    sock = listening_socket(host, port)
    port = sock.getsockname()[1]
    store = dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=sock.detach())
    return store, port


def interface_of(ip: str) -> str | None:
    """The name of the network interface that holds address `ip` on this host (None if none does)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addresses):
            return name
    return None
