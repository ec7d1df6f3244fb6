"""Engine fault tolerance: notice a dead SGLang engine, take it out of the router, restart it, and let it back in
only once it holds the trained weights. An engine that is alive but hung is killed first, and then handled as a dead
one. Hung means: a process of the engine is stopped (state T in /proc, SIGSTOP) in two checks in a row, which needs
no request to the engine and so holds as well while it is busy loading weights; or its `/health_generate` does not
answer within `hang_timeout_s`; while the job pauses the engines (a weight sync: a paused engine generates nothing,
so that probe would fail), its `/model_info` does not answer within `hang_timeout_s` (the HTTP process serves it
without the scheduler, so a paused engine or one loading a bucket answers at once, and a frozen one does not).

The states it moves each engine through (live -> restarting -> joining -> live again after the next weight sync,
which rebuilds the weight-sync group with it; failed if a restart fails) are kept in the job's `EngineSet`
(`slimish/engines/engine_set.py`), which everyone else reads. The job goes on with the engines it has, and fails
with a clear error when none is left. Requests that were running on a dead engine fail and are retried by the
scheduler on the others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from slimish.engines.client import EngineClient
from slimish.engines.engine_set import FAILED, JOINING, LIVE, RESTARTING, EngineSet
from slimish.engines.servers import EngineServers

logger = logging.getLogger(__name__)

class EngineWatchdog:
    """Watches `servers`' engines and keeps their states in `engines` (see `slimish.engines.engine_set`)."""

    def __init__(self, servers: EngineServers, engines: EngineSet, *, interval_s: float,
                 on_live_change: Callable[[list[str]], None], health_interval_s: float = 0.0,
                 hang_timeout_s: float = 0.0, api_key: str | None = None):
        self.servers, self.engines = servers, engines
        # /model_info answers 401 without the job's key, without asking the scheduler: a key-less probe would call
        # every engine hung
        self._clients = {url: EngineClient(url, api_key=api_key) for url in servers.engine_urls}
        self.interval_s = interval_s
        self.health_interval_s, self.hang_timeout_s = health_interval_s, hang_timeout_s
        self._on_live_change = on_live_change
        self._lock = engines.lock  # one lock for the states and the probes' bookkeeping below
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-watchdog", daemon=True)
        self._prober = threading.Thread(target=self._probe_loop, name="engine-prober", daemon=True)
        self._restarts: list[threading.Thread] = []
        # While the job pauses the engines the probe asks /model_info instead of /health_generate (which a paused
        # engine does not answer); a /health_generate probe that overlapped a pause is discarded: `_pauses` tells.
        self._paused, self._pauses = False, 0
        # /health_generate probes on their way: each is a request an engine runs, so an engine must not be told to
        # release its memory meanwhile (SGLang asserts its scheduler is idle then, and the server dies).
        self._generating = 0
        self._probes_done = threading.Condition(self._lock)
        self._killing: set[str] = set()  # hung engines being killed: each is killed (and counted) once
        self._stopped: dict[str, float] = {}  # engine -> when a check first found a process of it stopped

    def start(self) -> None:
        self._thread.start()
        if self.health_interval_s > 0 and self.hang_timeout_s > 0:
            self._prober.start()

    def pause_probes(self, *, until_idle: bool = False) -> None:
        """Probe with `/model_info` from now on; `until_idle`: return only once no `/health_generate` probe is on
        its way (each ends within `hang_timeout_s`), so that the engines run no request of the watchdog's."""
        with self._lock:
            self._paused, self._pauses = True, self._pauses + 1
            if until_idle:
                self._probes_done.wait_for(lambda: self._generating == 0)

    def resume_probes(self) -> None:
        with self._lock:
            self._paused = False

    def live(self) -> list[str]:
        return self.engines.live()

    def lost(self, urls: list[str]) -> list[str]:
        return self.engines.lost(urls)

    def lost_after_failure(self, urls: list[str], wait_s: float) -> list[str]:
        """After a weight sync to `urls` failed: those of them that died or hung (their restart has begun); []
        means the sync failed for another reason. Those that do not answer `/model_info` within `hang_timeout_s`
        are killed here, whether or not the prober got to them first. A death can reach the sender (its sockets
        closed) a moment before the process is seen to exit, so this looks again until one is found or `wait_s`
        has passed."""
        deadline = time.monotonic() + wait_s
        self.check()
        if not self.lost(urls) and self.hang_timeout_s > 0:
            self._kill_unresponsive(urls, paused=True)  # checks again itself when it kills one
        while True:
            lost = self.lost(urls)
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(0.2)
            self.check()

    def kill_hung(self, urls: list[str]) -> list[str]:
        """Kill those of `urls` still in service as hung, once each (a weight sync found them hung: see
        `RolloutManager.kill_hung`), then handle them as dead (`check`); returns those of `urls` out of service."""
        for i, url in enumerate(self.servers.engine_urls):
            if url not in urls:
                continue
            with self._lock:
                if not self.engines.in_service(url) or url in self._killing:
                    continue
                self._killing.add(url)
                self.engines.counts["hangs"] += 1
            logger.warning("engine %s is hung: it did not answer a weight-sync bucket by its deadline; killing it",
                           url)
            self.servers.kill_engine(i)
        self.check()
        return self.lost(urls)

    def admit(self, urls: list[str]) -> None:
        """`urls` now hold the trained weights: route requests to them again."""
        for url in urls:
            self.servers.router_add(url)
            self.engines.set(url, LIVE)
        if urls:
            self._on_live_change(self.live())

    def metrics(self) -> dict:
        return self.engines.metrics()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self._prober.is_alive():
            self._prober.join(timeout=self.hang_timeout_s + 10)
        for thread in self._restarts:
            thread.join(timeout=1)
        for client in self._clients.values():
            client.close()

    # ----------------------------------------------------------------------------------------- the thread
    def check(self) -> None:
        """Take every live or joining engine whose process has died out of service and start its restart; kill one
        whose processes were stopped at this check and the last (`_kill_stopped`). Called by the watchdog thread
        every `interval_s`, by `for_sync` and after a failed sync; each death is handled once (claimed under the
        lock)."""
        for i, url in enumerate(self.servers.engine_urls):
            if not self.engines.in_service(url):
                continue
            if self.servers.engine_alive(i):
                self._kill_stopped(i, url)
                continue
            with self._lock:
                if not self.engines.claim(url, RESTARTING, count="deaths"):  # the other caller claimed it meanwhile
                    continue
                self._killing.discard(url)
            try:
                self._on_death(i, url)
            except Exception:
                self._fail(url)

    def _kill_stopped(self, i: int, url: str) -> None:
        """Kill engine i if some of its processes are stopped now and were at an earlier check at least
        `interval_s` ago, with none of them running between (a stop seen once may be a moment's; a frozen engine
        stays stopped): a hang, found without asking the engine anything."""
        stopped, now = self.servers.engine_stopped(i), time.monotonic()
        with self._lock:
            if not stopped:
                self._stopped.pop(url, None)
                return
            first = self._stopped.setdefault(url, now)
            if first == now or now - first < self.interval_s or url in self._killing:
                return
            self._killing.add(url)
            del self._stopped[url]
            self.engines.counts["hangs"] += 1
        logger.warning("engine %s is frozen: its process(es) %s are stopped; killing it", url,
                       ", ".join(map(str, stopped)))
        self.servers.kill_engine(i)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()

    def probe(self) -> list[str]:
        """Kill every live or joining engine that does not answer its probe within `hang_timeout_s`, then `check()`
        handles it as dead; returns the engines killed. Unpaused, the probe is `/health_generate` (SGLang's own check
        answers 503 when its scheduler has produced nothing for 20 s; a stopped process does not answer), and nothing
        is killed on the strength of one that overlapped a pause. Paused, it is `/model_info`."""
        with self._lock:
            paused, pauses = self._paused, self._pauses
            urls = [url for url in self.engines.urls if self.engines.in_service(url)]
            self._generating += not paused  # counted before it is sent: see pause_probes(until_idle=True)
        try:
            return self._kill_unresponsive(urls, paused=paused, pauses=pauses)
        finally:
            if not paused:
                with self._lock:
                    self._generating -= 1
                    self._probes_done.notify_all()

    def _kill_unresponsive(self, urls: list[str], *, paused: bool, pauses: int = 0) -> list[str]:
        """Kill those of `urls` that do not answer the probe (`/model_info` when `paused`, else `/health_generate`,
        discarded if the job has paused the engines since the `pauses`-th pause); returns them."""
        path = "/model_info" if paused else "/health_generate"
        failures = dict(zip(urls, _in_parallel(lambda url: self._clients[url].probe(path, self.hang_timeout_s),
                                               urls)))
        hung = []
        for i, url in enumerate(self.servers.engine_urls):
            if failures.get(url) is None:
                continue
            # An engine that exited (killed, crashed) also answers nothing: that is a death, which check() handles,
            # not a hang. Asked after the probe failed, so whichever of the death and the probe came first, an
            # exited process is never counted as hung.
            if not self.servers.engine_alive(i):
                continue
            with self._lock:
                if not self.engines.in_service(url) or url in self._killing:
                    continue
                if not paused and (self._paused or self._pauses != pauses):  # /health_generate met a pause
                    continue
                self._killing.add(url)
                self.engines.counts["hangs"] += 1
            logger.warning("engine %s is hung: %s %s (the bound: %.0fs); killing it", url, path, failures[url],
                           self.hang_timeout_s)
            self.servers.kill_engine(i)
            hung.append(url)
        if hung or any(failures.values()):
            self.check()
        return hung

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            self.probe()

    def _on_death(self, i: int, url: str) -> None:
        logger.warning("engine %s died (exit code %s); restarting it; see %s/engine%d.log", url,
                       self.servers.engine_exit_code(i), self.servers.log_dir, i)
        self._on_live_change(self.live())
        try:
            self.servers.router_remove(url)
        except Exception as exc:  # the router keeps failing requests to it; the scheduler retries them
            logger.warning("could not remove %s from the router: %s", url, exc)
        # Waiting for it to become healthy takes a minute: on a thread of its own, so that the others stay watched.
        self.servers.respawn_engine(i)
        thread = threading.Thread(target=self._await_restart, args=(i, url), name=f"restart-{i}", daemon=True)
        self._restarts.append(thread)
        thread.start()

    def _fail(self, url: str) -> None:
        self.engines.set(url, FAILED, count="failures")
        logger.error("engine %s could not be restarted", url, exc_info=True)

    def _await_restart(self, i: int, url: str) -> None:
        t0 = time.monotonic()
        try:
            self.servers.wait_engine(i)
        except Exception:
            self._fail(url)
            return
        self.engines.set(url, JOINING, count="restarts")
        logger.warning("engine %s restarted in %.0fs; it joins at the next weight sync", url, time.monotonic() - t0)


def _in_parallel(fn: Callable, items: list) -> list:
    with ThreadPoolExecutor(max(1, len(items))) as pool:
        return list(pool.map(fn, items))
