"""A job sends its key only to listeners it started (slimish/engines/listener.py): the owner of a listening socket,
and an impostor on a job port (the router's, an engine's) stopping the start in one line before any request."""

from __future__ import annotations

import os
import sys

import httpx
import pytest

from slimish.engines.launch_router import API_KEY_ENV
from slimish.engines.listener import ForeignListener, check_listener
from slimish.engines.process import ManagedProcess
from slimish.engines.servers import router_argv
from slimish.network import free_port
from tests.kit.engines import LoopbackServer


class Impostor(LoopbackServer):
    """Someone else's HTTP server on a port: answers 200 to everything and records every request's method, path and
    Authorization header."""

    def __init__(self):
        self.requests = []
        super().__init__(self.answer)

    def answer(self, request: httpx.Request) -> httpx.Response:
        self.requests.append((request.method, request.url.raw_path.decode(), request.headers.get("Authorization")))
        return httpx.Response(200, content=b"{}")


@pytest.fixture
def impostor():
    with Impostor() as server:
        yield server


def _http_server(tmp_path, port: int) -> ManagedProcess:
    proc = ManagedProcess("server", [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                          env={}, log_path=tmp_path / "server.log")
    proc.start()
    return proc


def test_the_started_process_is_the_listener_and_anyone_else_is_foreign(tmp_path):
    port = free_port()
    proc = _http_server(tmp_path, port)
    other = ManagedProcess("other", [sys.executable, "-c", "import time; time.sleep(600)"], env={},
                           log_path=tmp_path / "other.log")  # a process of the job that does not listen there
    other.start()
    try:
        proc.wait_http_ok(f"http://127.0.0.1:{port}/", timeout_s=60, interval_s=0.2, own_port=(port, "some.port"))
        assert check_listener(port, owner_pid=proc.pid, what="server", key="some.port")
        with pytest.raises(ForeignListener, match=rf"^port {port}, where this job started me, is held by pid "
                                                  rf"{proc.pid} \(.*http.server.*\), not by the process the job "
                                                  r"started; .* set some.port to a free port \(0 picks one\)"):
            check_listener(port, owner_pid=other.pid, what="me", key="some.port")
    finally:
        proc.stop()
        other.stop()
    assert not check_listener(port, owner_pid=os.getpid(), what="me", key="some.port")  # nobody listens now


def test_a_router_whose_port_an_impostor_holds_stops_the_start_before_any_request(tmp_path, impostor):
    """The impostor binds the router's port first: the real router cannot bind it, and the job refuses in one line
    without asking the impostor anything (readiness included). Before the check the readiness probe got the
    impostor's 200 and the job's key followed with the first router call."""
    router = ManagedProcess("router", router_argv(worker_urls=["http://127.0.0.1:1"], port=impostor.port,
                                                  prometheus_port=free_port(), policy="round_robin"),
                            env={API_KEY_ENV: "the-job-key"}, log_path=tmp_path / "router.log")
    router.start()
    try:
        with pytest.raises(ForeignListener, match=rf"port {impostor.port}, where this job started router, is held by "
                                                  rf"pid {os.getpid()} "):
            router.wait_http_ok(f"http://127.0.0.1:{impostor.port}/readiness", timeout_s=120, interval_s=0.2,
                                own_port=(impostor.port, "rollout.router.port"))
    finally:
        router.stop()
    assert impostor.requests == []


def test_an_engine_whose_port_an_impostor_holds_is_never_probed(tmp_path, task_assets, impostor):
    """The same for an SGLang engine (`EngineProcess.ready`), with the real server starting on the taken port."""
    from slimish.config import load_config
    from slimish.engines.server import EngineProcess
    from tests.conftest import REPO

    cfg = load_config(REPO / "configs/quickstart_cpu.yaml", [
        f"model.hf_path={task_assets['model']}", f"data.path={task_assets['train']}", "eval.every=0",
        f"sft.data_path={task_assets['sft']}", f"rollout.engine.base_port={impostor.port}",
        "rollout.engine.num_engines=1"])
    engine = EngineProcess(index=0, rollout=cfg.rollout, model=cfg.model, log_dir=str(tmp_path), seed=0,
                           api_key="the-job-key")
    engine.start()
    try:
        with pytest.raises(ForeignListener, match=rf"port {impostor.port}, where this job started engine0, is held "
                                                  r"by .* set rollout.engine.base_port to a free port"):
            engine.ready()
    finally:
        engine.stop()
    assert impostor.requests == []
