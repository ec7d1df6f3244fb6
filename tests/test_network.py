"""The stores the job hosts listen on the address they are given only (torch's own TCPStore server listens on all
interfaces), serve their clients, and stop listening when dropped."""

from __future__ import annotations

import gc
from datetime import timedelta

import psutil
import torch.distributed as dist

from slimish.network import auth_headers, hosted_store, interface_of


def _listening(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN
            and c.laddr.port == port]


def test_a_hosted_store_listens_on_its_host_only_and_serves_clients():
    store, port = hosted_store("127.0.0.1", timeout=timedelta(seconds=10))
    assert _listening(port) == ["127.0.0.1"]
    client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
    client.set("weights", "v1")
    assert store.get("weights") == b"v1"
    del client, store
    gc.collect()
    assert _listening(port) == []


def test_torch_alone_would_listen_on_every_interface():
    """Why hosted_store exists: the same host name given to torch's TCPStore."""
    sock_port = hosted_store("127.0.0.1")[1]  # a free port, released when the store is dropped
    gc.collect()
    store = dist.TCPStore("127.0.0.1", sock_port, None, True, timedelta(seconds=10), wait_for_workers=False)
    assert set(_listening(sock_port)) & {"0.0.0.0", "::"}
    del store


def test_loopback_interface_and_auth_header():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.7") is None
    assert auth_headers("k") == {"Authorization": "Bearer k"} and auth_headers(None) == {}


def test_job_keys_parse_as_option_values():
    """A key is handed to SGLang's and the router's argument parsers as `--api-key KEY`; a key beginning with '-'
    would be taken for an option there ("expected one argument": 1 key in 64 of urlsafe base64 did)."""
    import argparse

    import pytest
    from sglang.srt.server_args import ServerArgs

    from slimish.network import new_job_key

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    for key in [new_job_key() for _ in range(256)]:
        assert parser.parse_args(["--model-path", "m", "--api-key", key]).api_key == key
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--model-path", "m", "--api-key", "-starts-with-a-dash"])


def test_a_job_has_two_keys_and_each_request_carries_the_one_its_endpoint_needs(tmp_path):
    """The admin key (weight updates, pause, abort) and the API key (generation, reads; the router's) are drawn
    independently; `EngineAuth` picks by path; a key file of one line serves as both (attached engines)."""
    import httpx

    from slimish.engines.client import EngineAuth
    from slimish.network import engine_keys, new_engine_keys, read_keys

    keys = new_engine_keys()
    assert keys.separate and keys.admin != keys.api

    def sent(path: str, key) -> str:
        request = httpx.Request("POST", f"http://127.0.0.1:1{path}")
        return next(EngineAuth(key).auth_flow(request)).headers.get("Authorization", "")

    assert sent("/update_weights_from_distributed", keys) == f"Bearer {keys.admin}"
    assert sent("/pause_generation", keys) == f"Bearer {keys.admin}"
    assert sent("/generate", keys) == sent("/model_info", keys) == f"Bearer {keys.api}"
    assert sent("/generate", "one") == sent("/pause_generation", "one") == "Bearer one"
    assert sent("/generate", None) == ""
    two, one = tmp_path / "two", tmp_path / "one"
    two.write_text(f"{keys.admin}\n{keys.api}\n")
    one.write_text("single\n")
    assert read_keys(str(two)) == keys and read_keys(str(one)) == engine_keys("single")


def test_a_service_port_is_free_and_outside_the_ephemeral_range():
    """Engines and the router bind their port some time after it is drawn; a port from the kernel's ephemeral range
    could meanwhile be given to any process's next socket (an engine's scheduler took the router's that way)."""
    import socket

    from slimish.network import SERVICE_PORTS_FROM, ephemeral_range, service_port

    low, _ = ephemeral_range()
    for _ in range(20):
        port = service_port()
        assert SERVICE_PORTS_FROM <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
