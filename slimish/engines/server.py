"""One SGLang engine: the server process on the node (and GPUs) Ray placed it on, started, watched and restarted by
a Ray actor of this class (`EngineServers` creates them). The process is started from the actor's own thread, so
that it dies with the actor (its parent-death signal fires when the thread that started it exits).

Listeners (slimish/network.py): the server binds the node's address; the store of SGLang's own torch.distributed
rendezvous is hosted here, on that address only, and SGLang joins it as a client through its documented override
(SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE=env://) and torch's agent-store convention (TORCHELASTIC_USE_AGENT_STORE
with MASTER_ADDR/MASTER_PORT): left to itself, SGLang's rank 0 would host it on all interfaces."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import yaml

from slimish.compat import sglang_cpu
from slimish.config.engine_flags import serving_args
from slimish.config.schema import ModelConfig, RolloutConfig
from slimish.engines.process import ManagedProcess
from slimish.network import hosted_store, node_ip

ENGINE_PATH = Path(__file__).with_name("engine_path")  # no __init__.py: not a package of slimish


def engine_env(tp: int = 1) -> dict[str, str]:
    """The environment of an SGLang server process of `tp` tensor-parallel ranks: `sglang_cpu.server_env()` (what a
    CPU-only machine needs), with `engine_path` first on PYTHONPATH, which hides Megatron-Core from the engine (see
    engine_path/megatron)."""
    env = sglang_cpu.server_env(tp=tp)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ENGINE_PATH), env.get("PYTHONPATH")]))
    return env


def engine_argv(*, model_path: str, host: str, port: int, device: str, dtype: str, tp: int, max_total_tokens: int,
                seed: int, extra: list[str], colocated: bool = False) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
            "--port", str(port), "--tp-size", str(tp), "--max-total-tokens", str(max_total_tokens),
            "--random-seed", str(seed), "--log-level", "warning",
            *sglang_cpu.server_args(device=device, dtype=dtype, tp=tp, colocated=colocated), *map(str, extra)]


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
    def __init__(self, *, index: int, rollout: RolloutConfig, model: ModelConfig, log_dir: str, seed: int,
                 api_key: str | None = None, colocated: bool = False):
        self.index, self.rollout, self.model, self.seed, self.api_key = index, rollout, model, seed, api_key
        self.colocated = colocated  # shares its GPUs with trainer ranks (placement.colocate)
        self.log_path = Path(log_dir) / f"engine{index}.log"
        self.host = node_ip()  # what other nodes reach this engine at (loopback on a local Ray)
        self.port = rollout.engine.base_port + index
        self.proc: ManagedProcess | None = None
        self._store = None  # the SGLang server's rendezvous store (a fresh one per start)
        self._secret_file: str | None = None  # the key, for SGLang's --config, until the server is up
        self.sender_gpus: dict | None = None  # colocated: the GPUs of the trainer rank that sends it weights

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, sender_gpus: dict | None = None) -> str:
        """Start the server (without waiting for it); returns its URL. `sender_gpus` (colocated: the node and
        CUDA_VISIBLE_DEVICES of the trainer rank that sends weights by CUDA IPC) is kept for restarts."""
        self.sender_gpus = sender_gpus or self.sender_gpus
        eng = self.rollout.engine
        argv = engine_argv(model_path=self.model.hf_path, host=self.host, port=self.port,
                           device=sglang_cpu.resolve_device(eng.device), dtype=self.model.dtype,
                           tp=eng.tensor_parallel, max_total_tokens=eng.max_total_tokens, seed=self.seed + self.index,
                           extra=[*serving_args(eng), *self._secret_args(), *eng.extra_args],
                           colocated=self.colocated)
        self._store, store_port = hosted_store(self.host)
        env = {**engine_env(eng.tensor_parallel), "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE": "env://",
               "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": self.host, "MASTER_PORT": str(store_port)}
        visible = visible_devices(env.get("CUDA_VISIBLE_DEVICES"), sender=self.sender_gpus, node=self.host)
        if visible:
            env["CUDA_VISIBLE_DEVICES"] = visible
        self.proc = ManagedProcess(f"engine{self.index}", argv, env=env, log_path=self.log_path)
        self.proc.start()
        return self.url

    def _secret_args(self) -> list[str]:
        """The key goes in through SGLang's `--config` YAML, in a file only this user can read, not on the command
        line, which every local user can read; the file is removed once the server is up."""
        if not self.api_key:
            return []
        self._remove_secret_file()
        fd, self._secret_file = tempfile.mkstemp(prefix=f"slimish-engine{self.index}-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump({"api-key": self.api_key}, f)  # the option's own spelling: "--" + key
        return ["--config", self._secret_file]

    def _remove_secret_file(self) -> None:
        if self._secret_file:
            Path(self._secret_file).unlink(missing_ok=True)
            self._secret_file = None

    def wait_healthy(self) -> None:
        self.proc.wait_http_ok(f"{self.url}/health_generate", self.rollout.engine.startup_timeout_s)
        self._remove_secret_file()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def stopped(self) -> list[int]:
        """The server's processes that are stopped (`ManagedProcess.stopped`): a frozen engine."""
        return self.proc.stopped() if self.proc is not None else []

    def exit_code(self) -> int | None:
        return self.proc.proc.returncode if self.proc is not None and self.proc.proc is not None else None

    def respawn(self) -> str:
        """Stop what is left of the old process group and start a fresh server on the same port."""
        self.stop(grace_s=2.0)
        return self.start()

    def gpu_telemetry(self) -> dict[str, float]:
        """The GPUs Ray gave this engine: memory and utilisation now ({} without GPUs)."""
        if not hasattr(self, "_telemetry"):
            from slimish.telemetry import GpuTelemetry

            self._telemetry = GpuTelemetry(f"engine{self.index}")
        return self._telemetry.sample()

    def info(self) -> dict:
        import ray

        return {"url": self.url, "pid": self.proc.pid if self.proc else None, "log": str(self.log_path),
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


