"""Engines for tests that need no real one: a `/generate` stand-in with its client, an `EngineClient` stand-in, and
a loopback HTTP server.

A handler here is a function of an `httpx.Request` returning an `httpx.Response`, or None to close the connection
unanswered (what a stopped process does); the same handler serves in process (`httpx.MockTransport(handler)`) or
over HTTP on 127.0.0.1 (`LoopbackServer(handler)`).

- `StandInEngine`: an SGLang engine's `/generate` and control calls, as such a handler (`generation_client(engine)`
  is a `GenerationClient` whose engine it is). Each input of a /generate request gets `answer(input_ids,
  sampling_params)`, or the next of `replies`, or by default `counted`; a batched request (a list of inputs) is
  answered by a list, in order. `refuse` makes /generate answer that HTTP status instead. Every other path (abort,
  pause, continue) answers `control_status`. It records every /generate body (`requests`) and (path, body) of every
  other call (`control`).
- `reply(...)`: one /generate answer in SGLang's shape (`output_ids`, `text`, `meta_info`'s finish reason, weight
  version and per-token logprobs).
- `StandInClient`: what the weight sync calls of an `EngineClient` (`weight_version`, `weight_checksums`,
  `update_weights_from_tensor`), answered from its fields; `clients_by_url(...)` is a `new_client` that hands them
  out.
- `LoopbackServer`: a handler served by a `ThreadingHTTPServer` bound to 127.0.0.1 on a free port, in a daemon thread
  (its request threads daemon too: a held request never delays the end), until `close()` or the end of its `with`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

Handler = Callable[[httpx.Request], httpx.Response | None]


def reply(output_ids: Sequence[int], *, finish: str = "stop", version: str = "default",
          logprobs: Sequence[float] | None = None, text: str | None = None) -> dict:
    """SGLang's answer to one input of a /generate: `output_ids` with `logprobs` (one each; default -0.1 * (k + 1)
    for token k), finished by `finish` ("stop", "length", "abort") at weight version `version`; `text` defaults to
    the ids joined by spaces."""
    ids = list(output_ids)
    logprobs = [-0.1 * (k + 1) for k in range(len(ids))] if logprobs is None else list(logprobs)
    return {"text": " ".join(map(str, ids)) if text is None else text, "output_ids": ids,
            "meta_info": {"finish_reason": {"type": finish}, "weight_version": version,
                          "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)]}}


class StandInEngine:
    """An SGLang engine at the HTTP boundary (see the module's docstring). `counted` is the default answer:
    `response_len` tokens (sum(input_ids) + k) % 50 + 1, fewer if the budget (`max_new_tokens`) is smaller, then
    finished by "length", else by "stop"; at weight version `version`. `answer` (a function of the input's ids and
    the request's sampling params) or `replies` (answers taken in turn, one per input) replace it."""

    def __init__(self, answer: Callable[[list[int], dict], dict] | None = None, *, replies: Sequence[dict] = (),
                 response_len: int = 3, version: str = "default", refuse: int | None = None,
                 control_status: int = 200):
        if answer is not None and replies:
            raise ValueError("answer or replies, not both")
        self.response_len, self.version = response_len, version
        self.refuse, self.control_status = refuse, control_status
        self.replies = list(replies)
        self.answer = answer or (self._next_reply if replies else self.counted)
        self.requests: list[dict] = []
        self.control: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        if request.url.path != "/generate":
            self.control.append((request.url.path, body))
            return httpx.Response(self.control_status, json={"success": self.control_status == 200})
        self.requests.append(body)
        if self.refuse is not None:
            return httpx.Response(self.refuse, json={"error": "refused by the stand-in engine"})
        inputs = body["input_ids"]
        batched = isinstance(inputs[0], list)
        answers = [self.answer(ids, body["sampling_params"]) for ids in (inputs if batched else [inputs])]
        return httpx.Response(200, json=answers if batched else answers[0])

    def counted(self, input_ids: list[int], sampling_params: dict) -> dict:
        budget = sampling_params["max_new_tokens"]
        out = [(sum(input_ids) + k) % 50 + 1 for k in range(min(self.response_len, budget))]
        return reply(out, finish="length" if len(out) == budget else "stop", version=self.version)

    def _next_reply(self, input_ids: list[int], sampling_params: dict) -> dict:
        return self.replies.pop(0)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


def generation_client(engine: Handler, url: str = "http://engine", *, request_timeout_s: float = 30,
                      max_concurrency: int = 4):
    """A `GenerationClient` of the router at `url` whose requests `engine` answers in process (create it on the
    event loop that uses it; `aclose()` it there)."""
    from slimish.engines.generation import GenerationClient

    return GenerationClient(url, request_timeout_s=request_timeout_s, max_concurrency=max_concurrency,
                            transport=httpx.MockTransport(engine))


class StandInClient:
    """Stands in for an `EngineClient` of the engine at `url`: it serves weight version `version`, each of its
    tensor-parallel ranks holds the checksums of `ranks` (name -> checksum), and it keeps each `serialized` argument of
    `update_weights_from_tensor` in `payloads`."""

    def __init__(self, url: str, version: str = "default", ranks: list[dict[str, str]] | None = None):
        self.url, self.version, self.ranks = url, version, ranks if ranks is not None else []
        self.payloads: list = []

    def weight_version(self) -> str:
        return self.version

    def weight_checksums(self) -> list[dict[str, str]]:
        return self.ranks

    def update_weights_from_tensor(self, *, serialized, **_) -> dict:
        self.payloads.append(serialized)
        return {}


def clients_by_url(clients: Sequence[StandInClient]):
    """A `new_client(url, api_key)` (as `sync_to` takes) that returns the stand-in of `url`."""
    by_url = {client.url: client for client in clients}
    return lambda url, api_key: by_url[url]


class LoopbackServer:
    """`handler` served over HTTP/1.0 at `url` (http://127.0.0.1:`port`). Each request reaches it as an
    `httpx.Request` (the URL at `url`, the request's headers and body) on a thread of its own; its `httpx.Response`
    is sent with its status, headers and body; None closes the connection unanswered."""

    def __init__(self, handler: Handler):
        class Serve(BaseHTTPRequestHandler):
            def _serve(self):
                length = int(self.headers.get("Content-Length") or 0)
                request = httpx.Request(self.command, f"{server.url}{self.path}", headers=list(self.headers.items()),
                                        content=self.rfile.read(length) if length else b"")
                response = handler(request)
                if response is None:
                    self.close_connection = True  # the client sees the connection end with no answer
                    return
                content = response.read()
                self.send_response(response.status_code)
                for name, value in response.headers.items():
                    if name.lower() != "content-length":
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PUT = do_DELETE = _serve

            def log_message(self, *args):
                pass

        server = self
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Serve)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop serving and free the port (requests still being handled are not waited for)."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

    def __enter__(self) -> LoopbackServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
