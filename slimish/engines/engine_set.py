"""Which engines serve, and in what state: one table that the watchdog writes and the driver (through the rollout
manager), the scheduler and the weight sync read, with a signal for whoever waits on a change.

States: live (routed to, and in the weight-sync group) -> restarting (its process died, or it hung and was killed;
a fresh one is starting) -> joining (healthy again, serving the initial checkpoint: not routed to until a weight
sync has reached it) -> live. failed: its restart failed; the job goes on with the others. A transition out of
service is claimed once (`claim`), so two observers of one death do not both handle it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable

LIVE, RESTARTING, JOINING, FAILED = "live", "restarting", "joining", "failed"
IN_SERVICE = (LIVE, JOINING)  # what a weight sync goes to


class NoEngineLeft(RuntimeError):
    pass


class EngineSet:
    """Thread-safe. `lock` is re-entrant: a caller holds it across a check and a `claim` that must not be
    interleaved (see the watchdog); `counts` tallies events (deaths, hangs, restarts, failures) under it."""

    def __init__(self, urls: Iterable[str]):
        self.urls = list(urls)
        self.lock = threading.RLock()
        self._changed = threading.Condition(self.lock)
        self._state = {url: LIVE for url in self.urls}
        self.counts: Counter = Counter()

    def state(self, url: str) -> str:
        with self.lock:
            return self._state[url]

    def in_service(self, url: str) -> bool:
        return self.state(url) in IN_SERVICE

    def live(self) -> list[str]:
        with self.lock:
            return [url for url in self.urls if self._state[url] == LIVE]

    def for_sync(self) -> dict:
        """{"urls": the engines a weight sync goes to (live and joining), "joining": those waiting to join};
        `NoEngineLeft` when there is none."""
        with self.lock:
            urls = [url for url in self.urls if self._state[url] in IN_SERVICE]
            joining = [url for url in self.urls if self._state[url] == JOINING]
            if not urls:
                raise NoEngineLeft(f"no SGLang engine is left: {self._state}; see the engine logs")
        return {"urls": urls, "joining": joining}

    def lost(self, urls: Iterable[str]) -> list[str]:
        """Those of `urls` out of service (restarting or failed)."""
        with self.lock:
            return [url for url in urls if self._state[url] not in IN_SERVICE]

    def set(self, url: str, state: str, *, count: str | None = None) -> None:
        """Move `url` to `state` (and count the event `count`); wakes whoever waits on a change."""
        with self.lock:
            self._state[url] = state
            if count:
                self.counts[count] += 1
            self._changed.notify_all()

    def claim(self, url: str, state: str, *, count: str) -> bool:
        """Take `url` out of service into `state` if it is still in service: True for the one caller that did."""
        with self.lock:
            if self._state[url] not in IN_SERVICE:
                return False
            self.set(url, state, count=count)
            return True

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Until `predicate()` (asked under the lock at each change) holds, or `timeout_s` passes: its last value."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout=timeout_s)

    def metrics(self) -> dict:
        with self.lock:
            states = Counter(self._state.values())
            return {"engines_live": states[LIVE], "engine_deaths": self.counts["deaths"],
                    "engine_hangs": self.counts["hangs"], "engine_restarts": self.counts["restarts"],
                    "engine_restart_failures": self.counts["failures"]}
