"""One SGLang engine: the server process on the node (and GPUs) Ray placed it on, started, watched and restarted by
a Ray actor of this class (`RolloutServers` creates them). The process is started from the actor's own thread, so
that it dies with the actor (its parent-death signal fires when the thread that started it exits)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from slimish.compat import sglang_cpu
from slimish.config.schema import ModelConfig, RolloutConfig
from slimish.orchestration.placement import node_ip
from slimish.rollout.processes import ManagedProcess


def engine_argv(*, model_path: str, host: str, port: int, device: str, dtype: str, tp: int, max_total_tokens: int,
                seed: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
            "--port", str(port), "--tp-size", str(tp), "--max-total-tokens", str(max_total_tokens),
            "--random-seed", str(seed), "--log-level", "warning",
            *sglang_cpu.server_args(device=device, dtype=dtype), *map(str, extra)]


class EngineProcess:
    def __init__(self, *, index: int, rollout: RolloutConfig, model: ModelConfig, log_dir: str, seed: int):
        self.index, self.rollout, self.model, self.seed = index, rollout, model, seed
        self.log_path = Path(log_dir) / f"engine{index}.log"
        self.host = node_ip()  # what other nodes reach this engine at (loopback on a local Ray)
        self.port = rollout.engine.base_port + index
        self.proc: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> str:
        """Start the server (without waiting for it); returns its URL."""
        eng = self.rollout.engine
        argv = engine_argv(model_path=self.model.hf_path, host=self.host, port=self.port,
                           device=sglang_cpu.resolve_device(eng.device), dtype=self.model.dtype,
                           tp=eng.tensor_parallel, max_total_tokens=eng.max_total_tokens, seed=self.seed + self.index,
                           extra=eng.extra_args)
        self.proc = ManagedProcess(f"engine{self.index}", argv, env=sglang_cpu.server_env(), log_path=self.log_path)
        self.proc.start()
        return self.url

    def wait_healthy(self) -> None:
        self.proc.wait_http_ok(f"{self.url}/health_generate", self.rollout.engine.startup_timeout_s)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

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


