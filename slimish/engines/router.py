"""The sglang-router's worker list: which engines it sends /generate to. Requests carry the job's key (the router
refuses its worker API without it)."""

from __future__ import annotations

import time

import httpx

from slimish.engines import timeouts
from slimish.engines.client import EngineAuth
from slimish.network import EngineKeys


class RouterClient:
    def __init__(self, url: str, *, api_key: EngineKeys | str | None = None):
        """`api_key`: the job's keys (every router endpoint takes the API key: `EngineAuth`) or one key."""
        self.url = url.rstrip("/")
        self._auth = EngineAuth(api_key)

    def workers(self) -> list[dict]:
        """The engines the router routes to, as it lists them (each with its "url" and "id")."""
        workers = httpx.get(f"{self.url}/workers", timeout=timeouts.ROUTER_S, auth=self._auth).json()
        return workers.get("workers", workers) if isinstance(workers, dict) else workers

    def wait_registered(self, count: int, timeout_s: float = timeouts.ROUTER_READY_S) -> None:
        """Until the router lists `count` engines (TimeoutError after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if len(self.workers()) >= count:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(timeouts.ROUTER_POLL_S)
        raise TimeoutError(f"router did not register {count} workers in {timeout_s:.0f}s")

    def remove(self, engine_url: str) -> None:
        """Stop routing to `engine_url` (the router has no retries: requests it still sends there fail and are
        retried by the scheduler)."""
        for worker in self.workers():
            if worker.get("url") == engine_url:
                resp = httpx.delete(f"{self.url}/workers/{worker['id']}", timeout=timeouts.ROUTER_S,
                                    auth=self._auth)
                resp.raise_for_status()

    def add(self, engine_url: str, timeout_s: float = timeouts.ROUTER_REGISTER_S) -> None:
        """Route to `engine_url` again, once the router lists it (TimeoutError after `timeout_s`)."""
        httpx.post(f"{self.url}/workers", json={"url": engine_url}, timeout=timeouts.ROUTER_S,
                   auth=self._auth).raise_for_status()
        deadline = time.monotonic() + timeout_s
        while not any(w.get("url") == engine_url for w in self.workers()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"router did not register {engine_url} in {timeout_s:.0f}s")
            time.sleep(0.2)
