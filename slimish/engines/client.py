"""Control calls to one SGLang engine, made directly (the router does not forward control endpoints), and its health
probes.

Field names follow sglang 0.5.23's `io_struct` (InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput,
BeginWeightUpdateReqInput, ...); `tests/engines/test_sglang_api_contract.py` freezes them.
"""

from __future__ import annotations

import time

import httpx

from slimish.engines import timeouts
from slimish.network import EngineKeys, engine_keys

# The endpoints slimish calls that need the admin key when the engine has one (SGLang 0.5.23's
# `@auth_level(ADMIN_OPTIONAL)` in sglang/srt/entrypoints/http_server.py; tests/engines/test_sglang_api_contract.py pins
# the list, which names no endpoint that no client calls): the rest take the API key. Health, readiness and metrics
# need neither.
ADMIN_PATHS = frozenset({
    "/abort_request", "/begin_weight_update", "/continue_generation", "/destroy_weights_update_group",
    "/end_weight_update", "/flush_cache", "/init_weights_update_group", "/pause_generation",
    "/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_disk",
    "/update_weights_from_distributed", "/update_weights_from_tensor", "/weights_checker",
})


class EngineAuth(httpx.Auth):
    """Each request carries the key its endpoint needs: the admin key for ADMIN_PATHS, else the API key (an
    engine's /generate, /model_info, /server_info, /v1/loads; every router endpoint). `keys`: EngineKeys, one key
    for both, or None (no header)."""

    def __init__(self, keys: EngineKeys | str | None):
        self.keys = engine_keys(keys)

    def auth_flow(self, request):
        if self.keys is not None:
            key = self.keys.admin if request.url.path in ADMIN_PATHS else self.keys.api
            request.headers["Authorization"] = f"Bearer {key}"
        yield request


# Control calls are few (per sync, per bucket) and short: each takes a new connection, closed after the reply,
# so that none is ever sent on a kept connection the engine is closing (see timeouts.py).
CONTROL_LIMITS = httpx.Limits(max_keepalive_connections=0)


class EngineError(RuntimeError):
    """Any failed control call: the engine could not be reached, timed out, answered non-200 or success=false.
    The message names the engine and the endpoint. One type for every cause, so that callers decide on one;
    `unreachable` tells the one cause some callers treat apart: no answer at all (no connection, or no reply in
    time), as from an engine that is gone."""

    def __init__(self, message: str, *, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


class EngineClient:
    """`api_key`: the job's keys (EngineKeys; one key for both), which engines started by a job require (None for
    an engine started without one); each call carries the one its endpoint needs (`EngineAuth`). `timeout_s`
    bounds each call (a weight update's by default)."""

    def __init__(self, url: str, timeout_s: float = timeouts.WEIGHT_UPDATE_S, *,
                 api_key: EngineKeys | str | None = None):
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, auth=EngineAuth(api_key),
                                  limits=CONTROL_LIMITS)

    def close(self) -> None:
        self._http.close()

    def probe(self, path: str, timeout_s: float) -> str | None:
        """None when the engine answers GET `path` with 200 within `timeout_s`; else what happened instead, for the
        log. `/health_generate` runs a generation (SGLang answers 503 when its scheduler has produced nothing for
        20 s); `/model_info` is served without the scheduler (a paused engine answers it at once)."""
        start = time.monotonic()
        try:
            status = self._http.get(path, timeout=timeout_s).status_code
        except httpx.HTTPError as exc:
            return f"gave no answer ({type(exc).__name__}) after {time.monotonic() - start:.1f}s"
        return None if status == 200 else f"answered {status} after {time.monotonic() - start:.1f}s"

    def _request(self, method: str, path: str, body: dict | None = None):
        try:
            resp = self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.url}{path}: {type(exc).__name__}: {exc}",
                              unreachable=isinstance(exc, httpx.TransportError)) from exc
        try:
            payload = resp.json()
        except ValueError:
            payload = {"text": resp.text}
        if resp.status_code != 200 or (isinstance(payload, dict) and payload.get("success") is False):
            raise EngineError(f"{self.url}{path} -> HTTP {resp.status_code}: {payload}")
        return payload

    def _post(self, path: str, body: dict | None = None):
        return self._request("POST", path, body or {})

    def model_info(self) -> dict:
        return self._request("GET", "/model_info")

    def server_info(self) -> dict:
        """The engine's start-up configuration (`model_path`: what it was started on, whatever it loaded since)."""
        return self._request("GET", "/server_info")

    def weight_version(self) -> str | None:
        return self.model_info().get("weight_version")

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> dict:
        return self._post("/init_weights_update_group", dict(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend))

    def destroy_weights_update_group(self, group_name: str) -> dict:
        return self._post("/destroy_weights_update_group", {"group_name": group_name})

    def begin_weight_update(self) -> dict:
        return self._post("/begin_weight_update", {"selector": "all"})

    def end_weight_update(self) -> dict:
        return self._post("/end_weight_update", {})

    def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, weight_version: str | None, flush_cache: bool,
                                        load_format: str | None = "flattened_bucket") -> dict:
        return self._post("/update_weights_from_distributed", dict(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=flush_cache,
            weight_version=weight_version, load_format=load_format))

    def update_weights_from_tensor(self, *, serialized: list[str], load_format: str | None,
                                   weight_version: str | None, flush_cache: bool) -> dict:
        """`serialized`: one base64 ForkingPickler payload per tensor-parallel rank of the engine."""
        return self._post("/update_weights_from_tensor", dict(
            serialized_named_tensors=serialized, load_format=load_format, flush_cache=flush_cache,
            weight_version=weight_version))

    def update_weights_from_disk(self, *, model_path: str, weight_version: str | None,
                                 flush_cache: bool = True) -> dict:
        return self._post("/update_weights_from_disk", dict(
            model_path=model_path, weight_version=weight_version, flush_cache=flush_cache))

    def weight_checksums(self) -> list[dict[str, str]]:
        """Per tensor-parallel rank of the engine, {parameter name: checksum} of every weight it holds
        (`/weights_checker`, action "checksum"; the hash is `slimish.weight_sync.checksums.tensor_checksum`)."""
        ranks = self._post("/weights_checker", {"action": "checksum"})["ranks"]
        places = [(r["parallelism_info"][0]["pp_rank"], r["parallelism_info"][0]["tp_rank"]) for r in ranks]
        return [rank["checksums"] for _, rank in sorted(zip(places, ranks), key=lambda pair: pair[0])]

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the engine's GPU memory of `tags` ("weights", "kv_cache", "cuda_graph"; None = all) for colocated
        trainer ranks; the engine must be idle. Released weights are not kept (unless SGLang's weights CPU backup
        is on): a weight sync must follow their resume. Frees GPU memory only with --enable-memory-saver."""
        self._post("/release_memory_occupation", {"tags": tags} if tags else {})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Take back what `release_memory_occupation(tags)` freed."""
        self._post("/resume_memory_occupation", {"tags": tags} if tags else {})

    def flush_cache(self) -> None:
        self._post("/flush_cache")

    def abort(self, rid: str | None = None) -> None:
        self._post("/abort_request", {"rid": rid} if rid else {"abort_all": True})

    def pause_generation(self, mode: str = "retract") -> None:
        self._post("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._post("/continue_generation", {})
