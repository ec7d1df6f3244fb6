"""Launch the SGLang engines and the sglang-router in front of them, all on loopback, and tear them down.

Router choices that matter for RL (see README "CPU notes"): retries off (a retried /generate is a duplicate
sample), circuit breaker off (it would answer 503 to everything after a few failures), Prometheus bound to
127.0.0.1, health checks on the cheap /ready endpoint (/health runs a generation).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from slimish.compat import sglang_cpu
from slimish.config.schema import ModelConfig, RolloutConfig
from slimish.rollout.processes import ManagedProcess

HOST = "127.0.0.1"


def engine_argv(*, model_path: str, port: int, device: str, dtype: str, tp: int, max_total_tokens: int,
                seed: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", HOST,
            "--port", str(port), "--tp-size", str(tp), "--max-total-tokens", str(max_total_tokens),
            "--random-seed", str(seed), "--log-level", "warning",
            *sglang_cpu.server_args(device=device, dtype=dtype), *map(str, extra)]


def router_argv(*, worker_urls: list[str], port: int, prometheus_port: int, policy: str) -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", HOST, "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy, "--disable-retries", "--disable-circuit-breaker",
            "--prometheus-host", HOST, "--prometheus-port", str(prometheus_port),
            "--health-check-endpoint", "/ready", "--health-check-interval-secs", "10", "--log-level", "warn"]


class RolloutServers:
    """N SGLang engines + one router. `engine_urls` for control calls, `router_url` for /generate."""

    def __init__(self, *, rollout: RolloutConfig, model: ModelConfig, log_dir: Path, seed: int):
        self.rollout, self.model, self.log_dir, self.seed = rollout, model, Path(log_dir), seed
        eng = rollout.engine
        self.device = sglang_cpu.resolve_device(eng.device)
        self.engine_urls = [f"http://{HOST}:{eng.base_port + i}" for i in range(eng.num_engines)]
        self.router_url = f"http://{HOST}:{rollout.router.port}"
        self.engines: list[ManagedProcess] = []
        self.router: ManagedProcess | None = None

    def _engine_process(self, i: int) -> ManagedProcess:
        eng = self.rollout.engine
        argv = engine_argv(model_path=self.model.hf_path, port=eng.base_port + i, device=self.device,
                           dtype=self.model.dtype, tp=eng.tensor_parallel, max_total_tokens=eng.max_total_tokens,
                           seed=self.seed + i, extra=eng.extra_args)
        return ManagedProcess(f"engine{i}", argv, env=sglang_cpu.server_env(),
                              log_path=self.log_dir / f"engine{i}.log")

    def _wait_engine(self, i: int) -> None:
        self.engines[i].wait_http_ok(f"{self.engine_urls[i]}/health_generate", self.rollout.engine.startup_timeout_s)

    def start(self) -> float:
        """Start everything and wait until healthy; returns the seconds it took."""
        t0 = time.monotonic()
        env = sglang_cpu.server_env()
        for i in range(len(self.engine_urls)):
            self.engines.append(self._engine_process(i))
            self.engines[-1].start()
        try:
            with ThreadPoolExecutor(len(self.engines)) as pool:
                list(pool.map(self._wait_engine, range(len(self.engines))))
            router = self.rollout.router
            self.router = ManagedProcess(
                "router", router_argv(worker_urls=self.engine_urls, port=router.port,
                                      prometheus_port=router.prometheus_port, policy=router.policy),
                env=env, log_path=self.log_dir / "router.log")
            self.router.start()
            self.router.wait_http_ok(f"{self.router_url}/readiness", timeout_s=120, interval_s=0.5)
            self._wait_workers_registered(timeout_s=120)
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - t0

    def _wait_workers_registered(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                workers = httpx.get(f"{self.router_url}/workers", timeout=5).json()
                listed = workers.get("workers", workers) if isinstance(workers, dict) else workers
                if len(listed) >= len(self.engine_urls):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"router did not register {len(self.engine_urls)} workers in {timeout_s}s")

    def engine_alive(self, i: int) -> bool:
        return self.engines[i].alive()

    def respawn_engine(self, i: int) -> None:
        """Replace engine `i` (dead) by a fresh process on the same port; `wait_engine(i)` then waits until it is
        healthy. It serves the checkpoint in model.hf_path until it receives the trained weights. Call it from a
        thread that outlives the engine: the engine's parent-death signal fires when the *thread* that started it
        exits."""
        self.engines[i].stop(grace_s=2.0)  # whatever is left of its process group (a crashed scheduler, ...)
        self.engines[i] = self._engine_process(i)
        self.engines[i].start()

    def wait_engine(self, i: int) -> None:
        self._wait_engine(i)

    def router_remove(self, url: str) -> None:
        """Stop routing to `url` (the router has no retries: requests it still sends there fail and are retried
        by the scheduler)."""
        for worker in self._router_workers():
            if worker.get("url") == url:
                resp = httpx.delete(f"{self.router_url}/workers/{worker['id']}", timeout=10)
                resp.raise_for_status()

    def router_add(self, url: str) -> None:
        httpx.post(f"{self.router_url}/workers", json={"url": url}, timeout=10).raise_for_status()
        deadline = time.monotonic() + 60
        while not any(w.get("url") == url for w in self._router_workers()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"router did not register {url} in 60s")
            time.sleep(0.2)

    def _router_workers(self) -> list[dict]:
        workers = httpx.get(f"{self.router_url}/workers", timeout=10).json()
        return workers.get("workers", workers) if isinstance(workers, dict) else workers

    def pids(self) -> list[int]:
        return [p.pid for p in [*self.engines, self.router] if p is not None and p.pid is not None]

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop router and engines together (a cancelled Slurm job has ~30 s before SIGKILL)."""
        procs = [p for p in [self.router, *self.engines] if p is not None]
        if procs:
            with ThreadPoolExecutor(len(procs)) as pool:
                list(pool.map(lambda p: p.stop(grace_s), procs))
