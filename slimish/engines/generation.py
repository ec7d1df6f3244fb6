"""Generation through the router, and control calls to many engines at once, from one asyncio loop (the rollout
scheduler's, or evaluation's).

`GenerationClient.generate(body)` POSTs a /generate body (built by `slimish.rollout.generate`) to the router and
returns the engine's reply, a list for a batched input; every failure is a `RequestError` that says whether a retry
may succeed. `pause_all`, `continue_all` and `abort_all` send a control call to each engine of a list directly (the
router does not forward them) and return the engines that failed; the endpoints they call are named here only, so
that callers (the rollout scheduler) never spell an engine's API.
"""

from __future__ import annotations

import asyncio

import httpx

from slimish.engines import timeouts
from slimish.engines.client import CONTROL_LIMITS, EngineAuth
from slimish.network import EngineKeys


class RequestError(RuntimeError):
    """A /generate request failed; `retriable` when its engine may have died (connection error, HTTP 5xx) rather
    than the request being wrong (HTTP 4xx, a malformed reply) or too slow (timeout)."""

    def __init__(self, message: str, *, retriable: bool):
        super().__init__(message)
        self.retriable = retriable


class GenerationClient:
    """`router_url`'s /generate with at most `max_concurrency` connections, each request bounded by
    `request_timeout_s` (rollout.request_timeout_s); control calls bounded by `timeouts.CONTROL_S`. Requests carry
    the job's key. `transport`: an httpx transport to use instead of the network (a test's stand-in engine).
    Create and use it on one event loop; `aclose()` it there."""

    def __init__(self, router_url: str, *, request_timeout_s: float, max_concurrency: int,
                 api_key: EngineKeys | str | None = None, transport: httpx.AsyncBaseTransport | None = None):
        self.router_url = router_url.rstrip("/")
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        auth = EngineAuth(api_key)  # /generate: the API key; abort, pause, continue: the admin key
        self._http = httpx.AsyncClient(timeout=request_timeout_s, limits=limits, auth=auth, transport=transport)
        # Control calls go to the engines themselves, a new connection each (client.CONTROL_LIMITS).
        self._control = httpx.AsyncClient(timeout=timeouts.CONTROL_S, auth=auth, transport=transport,
                                          limits=CONTROL_LIMITS)

    async def generate(self, body: dict) -> list[dict] | dict:
        """The reply to `body` (a list when `body["input_ids"]` is a batch); raises `RequestError`."""
        try:
            resp = await self._http.post(f"{self.router_url}/generate", json=body)
        except httpx.TimeoutException as exc:
            raise RequestError(f"{type(exc).__name__}: {exc}", retriable=False) from exc
        except httpx.TransportError as exc:
            raise RequestError(f"{type(exc).__name__}: {exc}", retriable=True) from exc
        if resp.status_code != 200:
            raise RequestError(f"HTTP {resp.status_code}: {resp.text[:300]}", retriable=resp.status_code >= 500)
        try:
            return resp.json()
        except ValueError as exc:
            raise RequestError(f"malformed reply: {exc}", retriable=False) from exc

    async def pause_all(self, urls: list[str], *, mode: str = "retract") -> dict[str, BaseException]:
        """Pause generation on every engine of `urls` (`mode` 'retract': running requests go back to the queue and
        free their KV cache); the failures by URL, as `_control_all`."""
        return await self._control_all(urls, "/pause_generation", {"mode": mode})

    async def continue_all(self, urls: list[str]) -> dict[str, BaseException]:
        """Let every engine of `urls` generate again after `pause_all`; the failures by URL, as `_control_all`."""
        return await self._control_all(urls, "/continue_generation", {})

    async def abort_all(self, urls: list[str]) -> dict[str, BaseException]:
        """Abort every running request on every engine of `urls` (each answers with the tokens so far); the
        failures by URL, as `_control_all`."""
        return await self._control_all(urls, "/abort_request", {"abort_all": True})

    async def _control_all(self, urls: list[str], path: str, body: dict) -> dict[str, BaseException]:
        """POST `body` to `path` on every engine of `urls` at once; returns the failures by URL ({} when all
        answered 200). An engine that fails may just have died: the caller reports it and goes on."""
        async def post(url: str) -> None:
            resp = await self._control.post(f"{url}{path}", json=body)
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")

        results = await asyncio.gather(*(post(url) for url in urls), return_exceptions=True)
        return {url: r for url, r in zip(urls, results, strict=True) if isinstance(r, BaseException)}

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._control.aclose()
