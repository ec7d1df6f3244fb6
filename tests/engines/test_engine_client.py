"""EngineClient raises EngineError, naming the engine and the endpoint, for every way a control call fails."""

from __future__ import annotations

import httpx
import pytest

from slimish.engines.client import EngineClient, EngineError
from tests.conftest import free_port
from tests.kit.engines import LoopbackServer


def answer(request: httpx.Request) -> httpx.Response:
    """/model_info -> 500; /begin_weight_update -> 200 {"success": false}; anything else -> 200 {}."""
    status, body = {"/model_info": (500, {"error": "boom"}),
                    "/begin_weight_update": (200, {"success": False, "message": "not paused"})}.get(
        request.url.path, (200, {}))
    return httpx.Response(status, json=body)


@pytest.fixture
def server():
    with LoopbackServer(answer) as engine:
        yield engine.url


def test_every_failure_is_an_engine_error_naming_the_call(server):
    client = EngineClient(server, timeout_s=5)
    with pytest.raises(EngineError, match=r"/model_info -> HTTP 500"):
        client.model_info()
    with pytest.raises(EngineError, match=r"/begin_weight_update -> HTTP 200: .*not paused"):
        client.begin_weight_update()
    assert client.end_weight_update() == {}
    client.close()
    down = EngineClient(f"http://127.0.0.1:{free_port()}", timeout_s=5)  # nothing listens there
    with pytest.raises(EngineError, match=r"/model_info: ConnectError"):
        down.weight_version()
    down.close()
