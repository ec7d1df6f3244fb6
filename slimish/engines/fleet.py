"""A job's engines as one thing: `EngineFleet`.

It owns the engine servers (the SGLang engines and the router), the engine set (each engine's state), the watchdog
that restarts dead or hung engines (when rollout.engine.restart_dead and the job started the engines), the memory
turns of colocated engines, and their GPU telemetry. The rollout side asks it for the live engines and is told when
they change (`on_live_change`); the weight sync asks it which engines to send to, which of them were lost, and
admits restarted ones after a sync. Without a watchdog the fleet answers as one would that never saw a fault.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from slimish.config.schema import RolloutConfig
from slimish.engines.client import EngineClient
from slimish.engines.engine_set import EngineSet
from slimish.engines.servers import EngineServers
from slimish.engines.watchdog import EngineWatchdog


class EngineFleet:
    """`servers` (not started); `rollout`: the job's rollout.* config (rollout.engine says whether and how the
    engines are watched)."""

    def __init__(self, servers: EngineServers, rollout: RolloutConfig):
        self.servers, self.rollout = servers, rollout
        self.engines: EngineSet | None = None
        self.watchdog: EngineWatchdog | _Unwatched = _Unwatched()
        self.released: set[str] = set()  # memory the engines have released (colocated: while the trainer trains)

    @property
    def api_key(self):
        return self.servers.api_key

    @property
    def router_url(self) -> str:
        return self.servers.router_url

    @property
    def engine_urls(self) -> list[str]:
        """Every engine, in engine order (in service or not)."""
        return self.servers.engine_urls

    def start(self, sender_gpus: list[dict] | None = None) -> dict:
        """Start the engines and the router (`sender_gpus[i]`: colocated, the GPUs of the trainer rank that sends
        engine i weights by CUDA IPC). Returns the start's figures: time_engines_start_s, engine_urls, router_url,
        pids, engines."""
        seconds = self.servers.start(sender_gpus)
        self.engines = EngineSet(self.servers.engine_urls)
        return {"time_engines_start_s": seconds, "engine_urls": self.servers.engine_urls,
                "router_url": self.servers.router_url, "pids": self.servers.pids(),
                "engines": self.servers.engine_info()}

    def watch(self, on_live_change: Callable[[list[str]], None]) -> None:
        """Start the watchdog (after `start`; when rollout.engine.restart_dead and the job started the engines),
        which calls `on_live_change(urls)` whenever the engines in service change."""
        engine = self.rollout.engine
        if engine.restart_dead and not engine.attach:  # the job cannot restart engines it did not start
            self.watchdog = EngineWatchdog(self.servers, self.engines, interval_s=engine.watch_interval_s,
                                           on_live_change=on_live_change, health_interval_s=engine.health_interval_s,
                                           hang_timeout_s=engine.hang_timeout_s, api_key=self.servers.api_key)
            self.watchdog.start()

    # ------------------------------------------------------------------------------------------ weight syncs
    def pause_probes(self) -> None:
        """Around a weight sync: a paused engine does not answer /health_generate, so the watchdog probes
        /model_info."""
        self.watchdog.pause_probes()

    def for_sync(self) -> dict:
        """{"urls": the engines the weight sync goes to, "joining": those of them restarted since the last one}
        (`EngineSet.for_sync`, after the watchdog has looked for engines that died since its last check)."""
        self.watchdog.check()
        return self.engines.for_sync()

    def out_of_service(self, urls: list[str]) -> list[str]:
        """While a weight sync to `urls` runs: those of them the watchdog has taken out of service (died, or frozen
        and killed: its thread checks every rollout.engine.watch_interval_s). Only reads the engine set."""
        return self.engines.lost(urls)

    def kill_hung(self, urls: list[str]) -> list[str]:
        """Kill `urls` as hung (they did not answer a weight-sync bucket by its deadline, though they may answer
        other calls); the watchdog restarts them. Returns those now out of service ([] without a watchdog)."""
        return self.watchdog.kill_hung(urls)

    def lost_after_failure(self, urls: list[str], wait_s: float = 10.0) -> list[str]:
        """After a weight sync to `urls` failed: those of them that died, or hung and were killed (their restart has
        begun); [] means the sync failed for another reason. See `EngineWatchdog.lost_after_failure`."""
        return self.watchdog.lost_after_failure(urls, wait_s)

    def admit(self, joined: list[str]) -> None:
        """After a whole weight sync: restarted engines that received it are routed to again."""
        self.watchdog.admit(list(joined))

    def resume_probes(self) -> None:
        """After a weight sync, once the engines generate again: the watchdog probes generation again (unless
        colocated engines have memory released)."""
        if not self.released:
            self.watchdog.resume_probes()

    # ------------------------------------------------------------------------------------------ colocation
    def release_memory(self, tags: list[str]) -> dict:
        """Colocated engines free their GPU memory of `tags` for the trainer ranks on their GPUs (they must be idle:
        between steps of rl.mode sync). Until `resume_memory` gives all of it back, the watchdog probes them
        without generating (`/model_info`). Returns {"time_release_s"}."""
        t0 = time.monotonic()
        self.watchdog.pause_probes(until_idle=True)
        self.released |= set(tags)
        self._on_live_engines(lambda client: client.release_memory_occupation(list(tags)))
        return {"time_release_s": time.monotonic() - t0}

    def resume_memory(self, tags: list[str]) -> dict:
        """Take back the memory `release_memory` freed, `tags` of it. Returns {"time_resume_s"}."""
        t0 = time.monotonic()
        self._on_live_engines(lambda client: client.resume_memory_occupation(list(tags)))
        self.released -= set(tags)
        self.resume_probes()
        return {"time_resume_s": time.monotonic() - t0}

    def _on_live_engines(self, call: Callable[[EngineClient], None]) -> None:
        """`call` on every live engine at once. An engine that died meanwhile is the watchdog's: its restart comes
        back with all its memory (and the served checkpoint, which the next full sync replaces)."""
        live = self.engines.live()
        with ThreadPoolExecutor(max(1, len(live))) as pool:
            futures = [pool.submit(_call_engine, url, self.servers.api_key, call) for url in live]
        failures = {url: f.exception() for url, f in zip(live, futures) if f.exception() is not None}
        lost = set(self.lost_after_failure(list(failures))) if failures else set()
        for url, exc in failures.items():
            if url not in lost:
                raise exc

    # ------------------------------------------------------------------------------------------ the rest
    def metrics(self) -> dict:
        """The watchdog's counters (engine deaths, restarts, ...; {} without a watchdog)."""
        return self.watchdog.metrics()

    def gpu_telemetry(self) -> dict[str, float]:
        return self.servers.gpu_telemetry()

    def stop(self) -> None:
        self.watchdog.stop()  # before the servers: it would take their stopping for deaths
        self.servers.stop()


class _Unwatched:
    """The watchdog of a fleet that restarts nothing (rollout.engine.restart_dead off, or attached engines): no probe,
    no engine ever lost."""

    def pause_probes(self, *, until_idle: bool = False) -> None:
        pass

    def resume_probes(self) -> None:
        pass

    def check(self) -> None:
        pass

    def admit(self, urls: list[str]) -> None:
        pass

    def kill_hung(self, urls: list[str]) -> list[str]:
        return []

    def lost_after_failure(self, urls: list[str], wait_s: float) -> list[str]:
        return []

    def metrics(self) -> dict:
        return {}

    def stop(self) -> None:
        pass


def _call_engine(url: str, api_key: str | None, call: Callable[[EngineClient], None]) -> None:
    client = EngineClient(url, api_key=api_key)
    try:
        call(client)
    finally:
        client.close()
