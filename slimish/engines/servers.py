"""Launch the SGLang engines (one Ray actor each, on the node and GPUs its placement slot holds) and the
sglang-router in front of them (a process of the rollout manager, on loopback), and tear them down.

Attached engines (`rollout.engine.attach`): engines this job did not start, kept up between jobs. The job resets
them at its start (`reset_attached`), puts its own router in front of them, and leaves them running at its end; it
cannot restart them.

Router choices that matter for RL (see README "CPU notes"): retries off (a retried /generate is a duplicate
sample), circuit breaker off (it would answer 503 to everything after a few failures), Prometheus bound to
127.0.0.1, health checks on the cheap /ready endpoint (/health runs a generation).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import ray

from slimish.compat import sglang_cpu
from slimish.config.schema import ModelConfig, RolloutConfig
from slimish.engines import timeouts
from slimish.engines.client import EngineClient, EngineError
from slimish.engines.launch_router import API_KEY_ENV
from slimish.engines.process import ManagedProcess
from slimish.engines.router import RouterClient
from slimish.engines.server import EngineProcess
from slimish.errors import UserError

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


def router_argv(*, worker_urls: list[str], port: int, prometheus_port: int, policy: str) -> list[str]:
    """sglang_router's launcher through ours (slimish.engines.launch_router): with the job's key in its environment,
    the router refuses clients without it (/generate and /workers alike) and sends it to the workers."""
    return [sys.executable, "-m", "slimish.engines.launch_router", "--host", HOST, "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy, "--disable-retries", "--disable-circuit-breaker",
            "--prometheus-host", HOST, "--prometheus-port", str(prometheus_port),
            "--health-check-endpoint", "/ready", "--health-check-interval-secs", "10", "--log-level", "warn"]


class EngineServers:
    """N SGLang engines + one router. `engine_urls` for control calls, `router_url` for /generate.

    `engine_options[i]` are the Ray actor options of engine i (its placement slot, see orchestration/placement);
    none with attached engines. With `api_key`, engines and router refuse callers without it (slimish/network.py);
    attached engines require the key they were started with. `colocated`: the engines share their GPUs with trainer
    ranks (placement.colocate) and release their memory while those train."""

    def __init__(self, *, rollout: RolloutConfig, model: ModelConfig, log_dir: Path, seed: int,
                 engine_options: list[dict], api_key: str | None = None, colocated: bool = False):
        self.attached = list(rollout.engine.attach)
        wanted = 0 if self.attached else rollout.engine.num_engines
        if len(engine_options) != wanted:
            raise ValueError(f"{len(engine_options)} placement slots for {wanted} engines to start")
        self.rollout, self.model, self.log_dir, self.seed = rollout, model, Path(log_dir), seed
        self.engine_options = engine_options
        self.api_key, self.colocated = api_key, colocated
        self.engine_urls: list[str] = []
        self.router_url = f"http://{HOST}:{rollout.router.port}"
        self.router_client = RouterClient(self.router_url, api_key=api_key)
        self.engines: list = []  # EngineProcess actors
        self.router: ManagedProcess | None = None

    def start(self, sender_gpus: list[dict] | None = None) -> float:
        """Start everything and wait until healthy; returns the seconds it took. `sender_gpus[i]`: engine i's, see
        `EngineProcess.start`."""
        t0 = time.monotonic()
        actor = ray.remote(EngineProcess)
        self.engines = [actor.options(**options).remote(index=i, rollout=self.rollout, model=self.model,
                                                        log_dir=str(self.log_dir), seed=self.seed,
                                                        api_key=self.api_key, colocated=self.colocated)
                        for i, options in enumerate(self.engine_options)]
        try:
            if self.attached:
                self.engine_urls = [url.rstrip("/") for url in self.attached]
                for url in self.engine_urls:
                    reset_attached(url, model_path=self.model.hf_path, api_key=self.api_key)
            else:
                self.engine_urls = ray.get([engine.start.remote(sender_gpus[i] if sender_gpus else None)
                                            for i, engine in enumerate(self.engines)])
                ray.get([engine.wait_healthy.remote() for engine in self.engines])
            router = self.rollout.router
            self.router = ManagedProcess(
                "router", router_argv(worker_urls=self.engine_urls, port=router.port,
                                      prometheus_port=router.prometheus_port, policy=router.policy),
                env={**sglang_cpu.server_env(), **({API_KEY_ENV: self.api_key} if self.api_key else {})},
                log_path=self.log_dir / "router.log")
            self.router.start()
            self.router.wait_http_ok(f"{self.router_url}/readiness", timeout_s=timeouts.ROUTER_READY_S,
                                     interval_s=0.5)
            self.router_client.wait_registered(len(self.engine_urls))
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - t0

    def engine_alive(self, i: int) -> bool:
        """False when engine i's server process exited, or its actor (or node) is gone."""
        if self.attached:
            raise RuntimeError("attached engines are not watched (no process of this job)")
        try:
            return ray.get(self.engines[i].alive.remote(), timeout=timeouts.ACTOR_CALL_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def engine_stopped(self, i: int) -> list[int]:
        """PIDs of engine i's processes that are stopped (frozen: they run nothing until continued); [] when none
        are, or its actor does not answer (`engine_alive` tells that apart)."""
        if self.attached:
            return []
        try:
            return ray.get(self.engines[i].stopped.remote(), timeout=timeouts.ACTOR_CALL_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return []

    def engine_exit_code(self, i: int) -> int | None:
        try:
            return ray.get(self.engines[i].exit_code.remote(), timeout=timeouts.ACTOR_CALL_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None

    def respawn_engine(self, i: int) -> None:
        """Replace engine i's (dead) server by a fresh one on the same node, GPUs and port; `wait_engine(i)` then
        waits until it is healthy. It serves the checkpoint in model.hf_path until it receives the trained
        weights."""
        ray.get(self.engines[i].respawn.remote())

    def kill_engine(self, i: int) -> None:
        """SIGKILL engine i's whole process group (a hung engine); the watchdog then sees it dead."""
        ray.get(self.engines[i].kill.remote(), timeout=timeouts.KILL_S)

    def wait_engine(self, i: int) -> None:
        ray.get(self.engines[i].wait_healthy.remote())

    def router_remove(self, url: str) -> None:
        """Stop routing to engine `url` (see `RouterClient.remove`)."""
        self.router_client.remove(url)

    def router_add(self, url: str) -> None:
        self.router_client.add(url)

    def gpu_telemetry(self) -> dict[str, float]:
        """Every engine's GPU memory and utilisation now; an engine that does not answer in time is left out."""
        out: dict[str, float] = {}
        for engine in self.engines:
            try:
                out.update(ray.get(engine.gpu_telemetry.remote(), timeout=timeouts.TELEMETRY_S))
            except Exception:  # a dead or restarting engine: the watchdog deals with it, telemetry just skips it
                continue
        return out

    def engine_info(self) -> list[dict]:
        """Per engine: URL, server PID, log file, Ray node id, CUDA_VISIBLE_DEVICES (attached engines: the URL
        alone, and `attached`)."""
        if self.attached:
            return [{"url": url, "attached": True, "pid": None} for url in self.engine_urls]
        return ray.get([engine.info.remote() for engine in self.engines])

    def pids(self) -> list[int]:
        """Server PIDs on their nodes: the engines', then the router's."""
        pids = [info["pid"] for info in self.engine_info() if info["pid"] is not None]
        return pids + ([self.router.pid] if self.router is not None and self.router.pid is not None else [])

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop router and engines together (a cancelled Slurm job has ~30 s before SIGKILL); the engine actors
        are then killed too. Attached engines keep running."""
        if self.router is not None:
            self.router.stop(grace_s)
        stops = [engine.stop.remote(grace_s) for engine in self.engines]
        try:
            ray.get(stops, timeout=grace_s + timeouts.STOP_EXTRA_S)
        except Exception as exc:  # an actor already gone: its server died with it (parent-death signal)
            logger.warning("stopping engines: %s", exc)
        for engine in self.engines:
            ray.kill(engine)


def reset_attached(url: str, *, model_path: str, api_key: str | None) -> None:
    """Make a running engine as a freshly started one serving `model_path`: unpaused, with no request of an earlier
    job left, the checkpoint reloaded from disk (weight version "0") and its caches flushed. A UserError in one
    line when it does not answer or serves another model."""
    client = EngineClient(url, timeout_s=timeouts.ATTACH_RESET_S, api_key=api_key)
    try:
        try:
            served = client.server_info().get("model_path")  # as started: a disk sync changes model_info's
        except EngineError as exc:
            raise UserError(f"rollout.engine.attach: {url} {'does not answer' if exc.unreachable else 'refused'} "
                            f"({exc}): start it, or attach engines that run with the key in "
                            "rollout.engine.attach_key_file") from None
        if served is None or Path(served).resolve() != Path(model_path).resolve():
            raise UserError(f"rollout.engine.attach: {url} serves {served}, not model.hf_path {model_path}: "
                            "attach engines started on the job's model")
        client.continue_generation()  # an earlier job may have left it paused (partial rollouts)
        client.abort()
        client.update_weights_from_disk(model_path=model_path, weight_version="0", flush_cache=True)
        logger.info("attached engine %s: reset to %s", url, model_path)
    finally:
        client.close()
