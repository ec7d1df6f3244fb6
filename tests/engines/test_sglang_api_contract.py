"""Freeze the SGLang request fields slimish sends, read from the installed sglang's own request structs.

If an SGLang upgrade renames or drops one of these, this fails before any engine is started.
"""

from __future__ import annotations

import dataclasses

import pytest

USED = {
    "GenerateReqInput": {"input_ids", "sampling_params", "return_logprob", "rid"},
    "InitWeightsUpdateGroupReqInput": {"master_address", "master_port", "rank_offset", "world_size", "group_name",
                                       "backend"},
    "UpdateWeightsFromDistributedReqInput": {"names", "dtypes", "shapes", "group_name", "flush_cache",
                                             "weight_version", "load_format"},
    "UpdateWeightFromDiskReqInput": {"model_path", "weight_version", "flush_cache"},
    "BeginWeightUpdateReqInput": {"selector"},
    "EndWeightUpdateReqInput": set(),
    "DestroyWeightsUpdateGroupReqInput": {"group_name"},
    "PauseGenerationReqInput": {"mode"},
    "ContinueGenerationReqInput": set(),
    "AbortReq": {"abort_all"},
}


def _fields(cls) -> set[str]:
    names = getattr(cls, "__struct_fields__", None)
    return set(names) if names is not None else {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("struct,used", sorted(USED.items()))
def test_request_fields_exist(struct, used):
    from sglang.srt.managers import io_struct

    assert used <= _fields(getattr(io_struct, struct))


def test_flattened_bucket_load_format_is_supported():
    import inspect

    from sglang.srt.model_executor.model_runner_components import weight_updater

    assert '"flattened_bucket"' in inspect.getsource(weight_updater)


def test_retract_pause_mode_exists():
    import typing

    from sglang.srt.managers.io_struct import PauseGenerationReqInput

    assert "retract" in typing.get_args(typing.get_type_hints(PauseGenerationReqInput)["mode"])


def test_weight_update_does_not_abort_requests_by_default():
    """Retract mode relies on it: /update_weights_from_distributed keeps retracted requests (whereas
    /update_weight_version aborts them unless told not to: measured, and why slimish never calls it)."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

    assert UpdateWeightsFromDistributedReqInput(names=[], dtypes=[], shapes=[]).abort_all_requests is False


def test_sampling_params_we_send_exist():
    from sglang.srt.sampling.sampling_params import SamplingParams

    from slimish.rollout.generate import SamplingParams as Ours

    sent = Ours(max_new_tokens=8, temperature=1.0, top_p=1.0, stop=("x",)).to_json()
    assert set(sent) <= set(_fields(SamplingParams))


def test_the_endpoints_we_call_exist():
    """Every path `EngineClient` calls is a route of the installed SGLang server (`/server_info`: the start-up
    configuration that `reset_attached` reads the engine's model from)."""
    import inspect
    import re

    from sglang.srt.entrypoints.http_server import app

    from slimish.engines import client

    called = set(re.findall(r'"(/[a-z_]+)"', inspect.getsource(client.EngineClient)))
    assert {"/server_info", "/model_info", "/update_weights_from_disk", "/continue_generation"} <= called
    def paths(routes):  # included routers (fastapi's _IncludedRouter) hold routes of their own
        for route in routes:
            if hasattr(route, "path"):
                yield route.path
            else:
                yield from paths(route.original_router.routes)

    assert called <= set(paths(app.routes))


def test_the_admin_key_goes_exactly_to_the_endpoints_that_need_it():
    """`EngineAuth` sends the admin key to ADMIN_PATHS and the API key elsewhere: every endpoint the clients call
    that SGLang marks ADMIN_OPTIONAL (with both keys set, it takes the admin key only) is in ADMIN_PATHS, and every
    one in ADMIN_PATHS is so marked and called; /generate, /model_info, /server_info and /v1/loads take the API key."""
    import inspect
    import re

    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.utils.auth import AuthLevel

    from slimish.engines import client, generation

    def routes(items):
        for route in items:
            if hasattr(route, "path"):
                yield route
            else:
                yield from routes(route.original_router.routes)

    level = {route.path: getattr(route.endpoint, "_auth_level", AuthLevel.NORMAL) for route in routes(app.routes)
             if hasattr(route, "endpoint")}
    called = {path for cls in (client.EngineClient, generation.GenerationClient)
              for path in re.findall(r'"(/[a-z_]+)"', inspect.getsource(cls))}
    assert {"/pause_generation", "/continue_generation", "/abort_request"} <= called  # GenerationClient's *_all
    admin = {path for path in called if level.get(path) == AuthLevel.ADMIN_OPTIONAL}
    assert admin == called & client.ADMIN_PATHS, sorted(admin ^ (called & client.ADMIN_PATHS))
    assert client.ADMIN_PATHS <= called, sorted(client.ADMIN_PATHS - called)  # no entry for an endpoint none calls
    assert all(level[path] == AuthLevel.ADMIN_OPTIONAL for path in client.ADMIN_PATHS), client.ADMIN_PATHS
    for path in ("/generate", "/model_info", "/server_info", "/v1/loads"):
        assert level.get(path, AuthLevel.NORMAL) == AuthLevel.NORMAL and path not in client.ADMIN_PATHS
    assert generation.EngineAuth is client.EngineAuth


def test_no_connection_to_an_engine_is_kept_idle_between_control_calls():
    """A kept idle connection races the engine's keep-alive close (SGLang's SGLANG_TIMEOUT_KEEP_ALIVE, uvicorn's
    timeout_keep_alive): a call sent on it as the engine closes it fails with 'Connection reset by peer' (a
    calculator job's weight sync failed so). The engine clients keep none: a new connection per control call, closed
    after the reply. Pinned with SGLang's keep-alive, which must stay on (else every call would close anyway)."""
    from sglang.srt.environ import envs

    from slimish.engines.client import EngineClient
    from slimish.engines.generation import GenerationClient

    assert envs.SGLANG_TIMEOUT_KEEP_ALIVE.default > 0
    client = EngineClient("http://127.0.0.1:1")
    assert client._http._transport._pool._max_keepalive_connections == 0
    client.close()
    control = GenerationClient("http://127.0.0.1:1", request_timeout_s=1, max_concurrency=1)._control
    assert control._transport._pool._max_keepalive_connections == 0
