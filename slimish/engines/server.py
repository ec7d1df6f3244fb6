"""One SGLang engine, or one node part of an engine spanning nodes: the server process on the node (and GPUs) Ray
placed it on, started and stopped by a Ray actor of this class (`EngineServers` creates one per part and watches
them). The process is started from the actor's own thread, so that it dies with the actor (its parent-death signal
fires when the thread that started it exits).

Listeners (slimish/network.py): the server binds the node's address; the store of SGLang's own torch.distributed
rendezvous is hosted by part 0's actor, on that address only, and every rank of the engine, on every node, joins it
as a client through SGLang's documented override (SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE=env://) and torch's
agent-store convention (TORCHELASTIC_USE_AGENT_STORE with MASTER_ADDR/MASTER_PORT): left to itself, SGLang's rank 0
would host it on all interfaces.

An engine spanning N nodes (`rollout.engine.nodes_per_engine`) runs the same command on each with `--nnodes N
--node-rank r`; SGLang puts tensor-parallel ranks [r * tp / N, (r + 1) * tp / N) on part r. Only part 0 runs the
tokenizer and the HTTP server; a part r > 0 serves SGLang's stand-in health endpoint (always 200, up once its
schedulers are), so what tells of it is its process."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import yaml

from slimish.compat import sglang_cpu
from slimish.config.engine_flags import loader_args, serving_args
from slimish.config.schema import ModelConfig, RolloutConfig
from slimish.engines.process import ManagedProcess
from slimish.network import engine_keys, hosted_store, node_ip, service_port

ENGINE_PATH = Path(__file__).with_name("engine_path")  # no __init__.py: not a package of slimish
# Variables set for the trainer's processes (launch/train.sbatch exports them to every Ray process) that an engine must
# not inherit. CUDA_DEVICE_MAX_CONNECTIONS=1 serialises a process's CUDA streams into one hardware queue, which
# Megatron's communication/computation overlap wants and SGLang's overlapped scheduling and weight loading do not
# (SGLang 0.5.23's server sets 8 itself before its schedulers start; an engine's environment does not rely on that).
TRAINER_ONLY_ENV = ("CUDA_DEVICE_MAX_CONNECTIONS",)


def engine_env(tp: int = 1, nnodes: int = 1) -> dict[str, str]:
    """The environment of an SGLang server process of `tp` tensor-parallel ranks over `nnodes` nodes:
    `sglang_cpu.server_env()` (what a CPU-only machine needs), with `engine_path` first on PYTHONPATH, which hides
    Megatron-Core from the engine (see engine_path/megatron), and without the trainer's own settings
    (`TRAINER_ONLY_ENV`)."""
    env = sglang_cpu.server_env(tp=tp, nnodes=nnodes)
    for name in TRAINER_ONLY_ENV:
        env.pop(name, None)
    sglang_cpu.prepend_pythonpath(env, ENGINE_PATH)
    return env


def engine_argv(*, model_path: str, host: str, port: int, device: str, dtype: str, tp: int, max_total_tokens: int,
                seed: int, extra: list[str], colocated: bool = False) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
            "--port", str(port), "--tp-size", str(tp), "--max-total-tokens", str(max_total_tokens),
            "--random-seed", str(seed), "--log-level", "warning",
            *sglang_cpu.server_args(device=device, dtype=dtype, tp=tp, colocated=colocated), *loader_args(),
            *map(str, extra)]


def node_args(*, nnodes: int, node_rank: int, rendezvous: tuple[str, int]) -> list[str]:
    """Which node part of an engine spanning `nnodes` nodes a server is ([] for an engine of one node).
    --dist-init-addr is the engine's rendezvous store: its ranks meet through SGLang's override (see the module's
    docstring), but SGLang derives the ports of data-parallel attention on part 0's node from it."""
    if nnodes == 1:
        return []
    host, port = rendezvous
    return ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", f"{host}:{port}"]


def visible_devices(own: str | None, *, sender: dict | None, node: str) -> str | None:
    """A colocated engine's CUDA_VISIBLE_DEVICES: its own GPU (Ray's choice, `own`) first, so that SGLang runs on
    device 0, then the GPU of the trainer rank that sends it weights by CUDA IPC (`sender`: that rank's node and
    CUDA_VISIBLE_DEVICES), when that is on this node and not its own: the engine opens the sender's buffer on the
    sender's device, which it must see (the handle names it by UUID; SGLang maps it to the index it sees it at).
    Otherwise `own` unchanged."""
    if not own or not sender or sender["node"] != node or not sender.get("cuda_visible_devices"):
        return own
    mine = own.split(",")
    theirs = [gpu for gpu in sender["cuda_visible_devices"].split(",") if gpu not in mine]
    return ",".join(mine + theirs)


class EngineProcess:
    """Part `part` of engine `index` (part 0 for an engine of one node)."""

    def __init__(self, *, index: int, rollout: RolloutConfig, model: ModelConfig, log_dir: str, seed: int,
                 api_key: str | None = None, colocated: bool = False, part: int = 0):
        self.index, self.rollout, self.model, self.seed, self.api_key = index, rollout, model, seed, api_key
        self.colocated = colocated  # shares its GPUs with trainer ranks (placement.colocate)
        eng = rollout.engine
        self.part, self.nnodes = part, eng.nodes_per_engine
        self.name = f"engine{index}" + (f"_part{part}" if part else "")
        self.log_path = Path(log_dir) / f"{self.name}.log"
        self.host = node_ip()  # what other nodes reach this engine at (loopback on a local Ray)
        # Parts of one engine are on distinct nodes, but simulated nodes share one host: no two listen on one port.
        # base_port 0: a free port of this node, kept for restarts (ready() checks it is still this server's).
        self.port = eng.base_port + index + part * eng.num_engines if eng.base_port else service_port()
        self.proc: ManagedProcess | None = None
        self._store = None  # part 0: the SGLang server's rendezvous store (a fresh one per start)
        self._rendezvous: tuple[str, int] | None = None  # where the engine's ranks meet (part 0's store)
        self._secret_file: str | None = None  # the key, for SGLang's --config, until the server is up
        self.sender_gpus: dict | None = None  # colocated: the GPUs of the trainer rank that sends it weights

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, sender_gpus: dict | None = None, rendezvous: tuple[str, int] | None = None) -> str:
        """Start the server (without waiting for it); returns its URL. `sender_gpus` (colocated: the node and
        CUDA_VISIBLE_DEVICES of the trainer rank that sends weights by CUDA IPC) is kept for restarts. Part 0 hosts a
        fresh rendezvous store (see `rendezvous`); a part r > 0 joins the one given, part 0's of this start."""
        self.sender_gpus = sender_gpus or self.sender_gpus
        if self.part == 0:
            self._store, store_port = hosted_store(self.host)
            self._rendezvous = (self.host, store_port)
        elif rendezvous is None:
            raise ValueError(f"{self.name}: a part beyond the first starts with part 0's rendezvous address")
        else:
            self._rendezvous = tuple(rendezvous)
        master_addr, master_port = self._rendezvous
        eng = self.rollout.engine
        argv = engine_argv(model_path=self.model.hf_path, host=self.host, port=self.port,
                           device=sglang_cpu.resolve_device(eng.device), dtype=self.model.dtype,
                           tp=eng.tensor_parallel, max_total_tokens=eng.max_total_tokens, seed=self.seed + self.index,
                           extra=[*serving_args(eng), *self._node_args(), *self._secret_args(), *eng.extra_args],
                           colocated=self.colocated)
        env = {**engine_env(eng.tensor_parallel, self.nnodes), "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE": "env://",
               "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
        if self.nnodes > 1:  # the address SGLang's broadcast queue binds for ranks on other nodes (else it guesses)
            env["SGLANG_HOST_IP"] = self.host
        visible = visible_devices(env.get("CUDA_VISIBLE_DEVICES"), sender=self.sender_gpus, node=self.host)
        if visible:
            env["CUDA_VISIBLE_DEVICES"] = visible
        self.proc = ManagedProcess(self.name, argv, env=env, log_path=self.log_path)
        self.proc.start()
        return self.url

    def rendezvous(self) -> tuple[str, int]:
        """Where the engine's ranks meet (part 0, after `start`): the address and port of its store."""
        return self._rendezvous

    def _node_args(self) -> list[str]:
        return node_args(nnodes=self.nnodes, node_rank=self.part, rendezvous=self._rendezvous)

    def _secret_args(self) -> list[str]:
        """The key goes in through SGLang's `--config` YAML, in a file only this user can read, not on the command
        line, which every local user can read; the file is removed once the server is up."""
        keys = engine_keys(self.api_key)
        if not keys:
            return []
        self._remove_secret_file()
        fd, self._secret_file = tempfile.mkstemp(prefix=f"slimish-engine{self.index}-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:  # the options' own spelling: "--" + key
            yaml.safe_dump({"api-key": keys.api, **({"admin-api-key": keys.admin} if keys.separate else {})}, f)
        return ["--config", self._secret_file]

    def _remove_secret_file(self) -> None:
        if self._secret_file:
            Path(self._secret_file).unlink(missing_ok=True)
            self._secret_file = None

    def ready(self) -> bool:
        """Whether the server is up now: part 0 answers /health_generate (a generation, so every rank of the engine
        is up); a part r > 0 answers its stand-in /health (its own schedulers are up). A RuntimeError (with the log
        tail) once its process exited."""
        # Only once this server holds its port: until then a probe (and then the job's key) could reach another
        # process that took it (a ForeignListener stops the job).
        if not self.proc.listening(self.port, key="rollout.engine.base_port"):
            return False
        ok = self.proc.http_ok(f"{self.url}/{'health_generate' if self.part == 0 else 'health'}")
        if ok:
            self._remove_secret_file()
        return ok

    def log_tail(self) -> str:
        return self.proc.log_tail() if self.proc is not None else ""

    def commands(self) -> list[str]:
        """The command names of the server's processes now (`ManagedProcess.commands`)."""
        return self.proc.commands() if self.proc is not None else []

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def stopped(self) -> list[int]:
        """The server's processes that are stopped (`ManagedProcess.stopped`): a frozen engine."""
        return self.proc.stopped() if self.proc is not None else []

    def exit_code(self) -> int | None:
        return self.proc.proc.returncode if self.proc is not None and self.proc.proc is not None else None

    def gpu_telemetry(self) -> dict[str, float]:
        """The GPUs Ray gave this engine: memory and utilisation now ({} without GPUs)."""
        if not hasattr(self, "_telemetry"):
            from slimish.telemetry import GpuTelemetry

            self._telemetry = GpuTelemetry(self.name)
        return self._telemetry.sample()

    def info(self) -> dict:
        import ray

        return {"url": self.url, "part": self.part, "pid": self.proc.pid if self.proc else None,
                "log": str(self.log_path),
                "node_id": ray.get_runtime_context().get_node_id(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def kill(self) -> None:
        """Kill the server's process group at once (no SIGTERM grace: it is hung) and reap it."""
        if self.proc is not None:
            self.proc.stop(grace_s=0)

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc is not None:
            self.proc.stop(grace_s)
        self._store = None
        self._remove_secret_file()


