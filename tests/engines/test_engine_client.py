"""EngineClient raises EngineError, naming the engine and the endpoint, for every way a control call fails."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from slimish.engines.client import EngineClient, EngineError
from tests.conftest import free_port


class _Handler(http.server.BaseHTTPRequestHandler):
    """/model_info -> 500; /begin_weight_update -> 200 {"success": false}; anything else -> 200 {}."""

    def _reply(self):
        status, body = {"/model_info": (500, {"error": "boom"}),
                        "/begin_weight_update": (200, {"success": False, "message": "not paused"})}.get(
            self.path, (200, {}))
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - the http.server API
        self._reply()

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._reply()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


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
