"""Launch the SGLang engines (one Ray actor each, on the node and GPUs its placement slot holds; an engine spanning
nodes, one per node part) and the sglang-router in front of them (a process of the rollout manager, on loopback),
and tear them down. An engine is one unit whatever its parts: one URL (its part 0's), alive while every part's
process is, restarted whole.

Attached engines (`rollout.engine.attach`): engines this job did not start, kept up between jobs. The job resets
them at its start (`reset_attached`), puts its own router in front of them, and leaves them running at its end; it
cannot restart them.

Router choices that matter for RL (see README "CPU notes"): retries off (a retried /generate is a duplicate
sample), circuit breaker off (it would answer 503 to everything after a few failures), Prometheus bound to
127.0.0.1, health checks on /ping (HEALTH_CHECK_ENDPOINT).
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
from slimish.engines.startup import waiting_for
from slimish.errors import UserError
from slimish.network import engine_keys, service_port

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
# What the router health-checks its engines on: SGLang's /ping, a flag check that a paused engine still passes.
# Not /health (it runs a generation, which a paused engine never finishes) nor /ready (503 while paused): an engine
# paused for a weight sync or a colocated training step longer than the router's failure threshold (3 checks, 10 s
# apart) would be marked unhealthy, and the router would answer 503 "no available workers" to every request until
# two checks after the resume. /ping needs the job's key, which the router sends.
HEALTH_CHECK_ENDPOINT = "/ping"


def router_argv(*, worker_urls: list[str], port: int, prometheus_port: int, policy: str) -> list[str]:
    """sglang_router's Rust router through slimish's launcher (slimish.engines.launch_router, which does not import
    SGLang as sglang_router's own launcher does): with the job's key in its environment, the router refuses
    clients without it (/generate and /workers alike) and sends it to the workers."""
    return [sys.executable, "-m", "slimish.engines.launch_router", "--host", HOST, "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy, "--disable-retries", "--disable-circuit-breaker",
            "--prometheus-host", HOST, "--prometheus-port", str(prometheus_port), "--health-check-endpoint",
            HEALTH_CHECK_ENDPOINT, "--health-check-interval-secs", "10", "--log-level", "warn"]


class EngineServers:
    """N SGLang engines + one router. `engine_urls` for control calls, `router_url` for /generate.

    `engine_options[i][r]` are the Ray actor options of part r of engine i (its placement slot, see
    orchestration/placement; one part unless the engine spans nodes); none with attached engines. With `api_key`,
    engines and router refuse callers without it (slimish/network.py); attached engines require the key they were
    started with. `colocated`: the engines share their GPUs with trainer ranks (placement.colocate) and release their
    memory while those train."""

    def __init__(self, *, rollout: RolloutConfig, model: ModelConfig, log_dir: Path, seed: int,
                 engine_options: list[list[dict]], api_key: str | None = None, colocated: bool = False):
        self.attached = list(rollout.engine.attach)
        wanted = 0 if self.attached else rollout.engine.num_engines
        if len(engine_options) != wanted:
            raise ValueError(f"{len(engine_options)} placement slots for {wanted} engines to start")
        self.rollout, self.model, self.log_dir, self.seed = rollout, model, Path(log_dir), seed
        self.engine_options = engine_options
        self.api_key, self.colocated = api_key, colocated
        self.engine_urls: list[str] = []
        self.router_port, self.prometheus_port = rollout.router.port, rollout.router.prometheus_port  # 0: at start
        self.router_url = ""
        self.router_client: RouterClient | None = None
        self.engines: list[list] = []  # per engine, the EngineProcess actors of its node parts
        self.router: ManagedProcess | None = None

    def start(self, sender_gpus: list[dict] | None = None) -> float:
        """Start everything and wait until healthy; returns the seconds it took. `sender_gpus[i]`: engine i's, see
        `EngineProcess.start`."""
        t0 = time.monotonic()
        actor = ray.remote(EngineProcess)
        self.engines = [[actor.options(**options).remote(index=i, part=r, rollout=self.rollout, model=self.model,
                                                         log_dir=str(self.log_dir), seed=self.seed,
                                                         api_key=self.api_key, colocated=self.colocated)
                         for r, options in enumerate(parts)]
                        for i, parts in enumerate(self.engine_options)]
        try:
            if self.attached:
                self.engine_urls = [url.rstrip("/") for url in self.attached]
                for url in self.engine_urls:
                    reset_attached(url, model_path=self.model.hf_path, api_key=self.api_key)
            else:
                indices = range(len(self.engines))
                self.engine_urls = self._start(indices, sender_gpus)
                self._wait_healthy(indices)
            router = self.rollout.router
            # Port 0: free ones of this node (the router runs beside this process), so that jobs run side by side,
            # drawn now (the engines are up, every port of theirs bound) and outside the ephemeral range.
            self.router_port = router.port or service_port()
            self.prometheus_port = router.prometheus_port or service_port()
            self.router_url = f"http://{HOST}:{self.router_port}"
            self.router_client = RouterClient(self.router_url, api_key=self.api_key)
            self.router = ManagedProcess(
                "router", router_argv(worker_urls=self.engine_urls, port=self.router_port,
                                      prometheus_port=self.prometheus_port, policy=router.policy),
                # The router gets the API key only: it cannot update weights.
                env={**sglang_cpu.server_env(), **({API_KEY_ENV: engine_keys(self.api_key).api} if self.api_key
                                                    else {})},
                log_path=self.log_dir / "router.log")
            self.router.start()
            self.router.wait_http_ok(f"{self.router_url}/readiness", timeout_s=timeouts.ROUTER_READY_S,
                                     interval_s=timeouts.ROUTER_POLL_S,
                                     own_port=(self.router_port, "rollout.router.port"))
            self.router_client.wait_registered(len(self.engine_urls))
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - t0

    def _start(self, indices, sender_gpus: list[dict] | None = None) -> list[str]:
        """Start engines `indices` without waiting for them; their URLs. Part 0 of each first: the other parts join
        the rendezvous it hosts."""
        urls = ray.get([self.engines[i][0].start.remote(sender_gpus[i] if sender_gpus else None) for i in indices])
        spanning = [i for i in indices if len(self.engines[i]) > 1]
        meeting = ray.get([self.engines[i][0].rendezvous.remote() for i in spanning])
        ray.get([part.start.remote(None, rendezvous)
                 for i, rendezvous in zip(spanning, meeting, strict=True) for part in self.engines[i][1:]])
        return urls

    def _wait_healthy(self, indices) -> None:
        """Until every part of engines `indices` is up (`EngineProcess.ready`): a RuntimeError with the log tail as
        soon as one's process exits (a part whose peer died may wait for it in SGLang's rendezvous for many
        minutes), a TimeoutError after rollout.engine.startup_timeout_s."""
        timeout_s = self.rollout.engine.startup_timeout_s
        deadline = time.monotonic() + timeout_s
        waiting = [part for i in indices for part in self.engines[i]]
        while waiting:
            ready = ray.get([part.ready.remote() for part in waiting])
            waiting = [part for part, ok in zip(waiting, ready, strict=True) if not ok]
            if waiting and time.monotonic() > deadline:
                late = waiting[0]
                info = ray.get(late.info.remote())
                what = waiting_for(ray.get(late.commands.remote()), part=info["part"])
                raise TimeoutError(f"engine part {info['log']} not ready after {timeout_s:.0f}s, waiting for {what}; "
                                   f"its log ends:\n{ray.get(late.log_tail.remote())}")
            if waiting:
                time.sleep(1.0)

    def _parts(self, i: int, method: str, *args, timeout: float = timeouts.ACTOR_CALL_S) -> list:
        """`method` of every part of engine i, in part order."""
        return ray.get([getattr(part, method).remote(*args) for part in self.engines[i]], timeout=timeout)

    def engine_alive(self, i: int) -> bool:
        """False when the server process of any part of engine i exited, or its actor (or node) is gone."""
        if self.attached:
            raise RuntimeError("attached engines are not watched (no process of this job)")
        try:
            return all(self._parts(i, "alive"))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def engine_stopped(self, i: int) -> list[int]:
        """PIDs of engine i's processes (any part's) that are stopped (frozen: they run nothing until continued); []
        when none are, or an actor does not answer (`engine_alive` tells that apart)."""
        if self.attached:
            return []
        try:
            return [pid for pids in self._parts(i, "stopped") for pid in pids]
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return []

    def engine_exit_code(self, i: int) -> int | None:
        """The exit code of the first part of engine i whose process exited (None: none has, or it is unknown)."""
        try:
            return next((code for code in self._parts(i, "exit_code") if code is not None), None)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None

    def respawn_engine(self, i: int) -> None:
        """Replace engine i's (dead) server by a fresh one on the same node(s), GPUs and port(s): every part of it,
        whichever died; `wait_engine(i)` then waits until it is healthy. It serves the checkpoint in model.hf_path
        until it receives the trained weights."""
        self._parts(i, "stop", 2.0, timeout=None)
        self._start([i])

    def kill_engine(self, i: int) -> None:
        """SIGKILL the process group of every part of engine i (a hung engine); the watchdog then sees it dead."""
        self._parts(i, "kill", timeout=timeouts.KILL_S)

    def wait_engine(self, i: int) -> None:
        """Wait until engine i is healthy (`_wait_healthy`); when it is not, kill what is left of it (a part may be
        waiting for a dead one) and raise."""
        try:
            self._wait_healthy([i])
        except BaseException:
            self.kill_engine(i)
            raise

    def router_remove(self, url: str) -> None:
        """Stop routing to engine `url` (see `RouterClient.remove`)."""
        self.router_client.remove(url)

    def router_add(self, url: str) -> None:
        self.router_client.add(url)

    def gpu_telemetry(self) -> dict[str, float]:
        """Every engine's GPU memory and utilisation now; an engine that does not answer in time is left out."""
        out: dict[str, float] = {}
        for part in (part for parts in self.engines for part in parts):
            try:
                out.update(ray.get(part.gpu_telemetry.remote(), timeout=timeouts.TELEMETRY_S))
            except Exception:  # a dead or restarting engine: the watchdog deals with it, telemetry just skips it
                continue
        return out

    def engine_info(self) -> list[dict]:
        """Per engine: URL, server PID, log file, Ray node id, CUDA_VISIBLE_DEVICES of its part 0, and the same of
        every part under "parts" (attached engines: the URL alone, and `attached`)."""
        if self.attached:
            return [{"url": url, "attached": True, "pid": None, "parts": []} for url in self.engine_urls]
        infos = iter(ray.get([part.info.remote() for engine in self.engines for part in engine]))
        return [{**parts[0], "parts": parts} for parts in ([next(infos) for _ in engine] for engine in self.engines)]

    def pids(self) -> list[int]:
        """Server PIDs on their nodes: the engines' (every part's), then the router's."""
        pids = [part["pid"] for info in self.engine_info() for part in info["parts"] if part["pid"] is not None]
        return pids + ([self.router.pid] if self.router is not None and self.router.pid is not None else [])

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop router and engines together (a cancelled Slurm job has ~30 s before SIGKILL); the engine actors
        are then killed too. Attached engines keep running."""
        if self.router is not None:
            self.router.stop(grace_s)
        parts = [part for engine in self.engines for part in engine]
        try:
            ray.get([part.stop.remote(grace_s) for part in parts], timeout=grace_s + timeouts.STOP_EXTRA_S)
        except Exception as exc:  # an actor already gone: its server died with it (parent-death signal)
            logger.warning("stopping engines: %s", exc)
        for part in parts:
            ray.kill(part)


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
