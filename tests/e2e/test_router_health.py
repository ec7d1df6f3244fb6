"""The router's health checks against a paused engine, on the session's shared engines."""

from __future__ import annotations

import httpx

from slimish.engines.servers import HEALTH_CHECK_ENDPOINT, router_argv
from slimish.network import auth_headers


def test_an_engine_paused_for_a_sync_passes_the_router_health_check(attached):
    """The endpoint the router health-checks answers 200 (with the job's key, which the router sends) while an
    engine is paused in each of the driver's modes. A pause outlasting the router's failure threshold (3 checks, 10 s
    apart) on an endpoint that fails it left the router answering 503 "no available workers" to every request until
    two checks after the resume: the retract-mode test's frozen engines did, on a slow machine. /ready is such an
    endpoint (checked here, so that the reason stays visible)."""
    url = attached.urls[0]
    argv = router_argv(worker_urls=[url], port=1, prometheus_port=2, policy="round_robin")
    assert argv[argv.index("--health-check-endpoint") + 1] == HEALTH_CHECK_ENDPOINT
    client = attached.client(url)
    try:
        with httpx.Client(headers=auth_headers(attached.key), timeout=30) as http:
            for mode in ("in_place", "retract", "abort"):
                client.pause_generation(mode=mode)
                try:
                    assert http.get(f"{url}{HEALTH_CHECK_ENDPOINT}").status_code == 200, mode
                    assert http.get(f"{url}/ready").status_code == 503, mode
                finally:
                    client.continue_generation()
            assert http.get(f"{url}/ready").status_code == 200
    finally:
        client.close()
