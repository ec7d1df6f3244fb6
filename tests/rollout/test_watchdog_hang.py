"""The watchdog's hang probe: an engine process that is alive but does not answer `/health_generate` in time is
killed (and so handled as a dead engine); a healthy one is left alone; nothing is killed on the strength of a probe
that overlapped a pause of the engines (a paused engine does not answer either).

The engines are stand-in HTTP servers (one answers, one holds every request until the test lets go) behind a
stand-in of `RolloutServers`: this tests the watchdog's logic, not SGLang (the crash e2e test runs real engines)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slimish.rollout.watchdog import EngineWatchdog


class StandInEngine:
    """An HTTP server on 127.0.0.1 whose /health_generate answers 200, or (hung) waits for `release`."""

    def __init__(self, *, hung: bool, on_request=None):
        self.release = threading.Event()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if engine.hung:
                    if on_request is not None:
                        on_request()
                    engine.release.wait(30)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.hung = hung
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class StandInServers:
    """What the watchdog uses of RolloutServers; a killed engine stays dead (restarts are not under test)."""

    log_dir = "logs"

    def __init__(self, engines):
        self.engines = engines
        self.engine_urls = [e.url for e in engines]
        self.killed: list[int] = []
        self.respawned: list[int] = []

    def engine_alive(self, i):
        return i not in self.killed

    def engine_exit_code(self, i):
        return -9

    def kill_engine(self, i):
        self.killed.append(i)

    def router_remove(self, url):
        pass

    def respawn_engine(self, i):
        self.respawned.append(i)

    def wait_engine(self, i):
        raise RuntimeError("not restarted in this test")


@pytest.fixture
def engines():
    made = []
    yield made
    for engine in made:
        engine.close()


def test_a_hung_engine_is_killed_and_handled_as_dead(engines):
    engines += [StandInEngine(hung=False), StandInEngine(hung=True)]
    servers = StandInServers(engines)
    watchdog = EngineWatchdog(servers, interval_s=3600, on_live_change=lambda urls: None, hang_timeout_s=0.5)
    assert watchdog.probe() == [engines[1].url]
    assert servers.killed == [1] and servers.respawned == [1]
    assert watchdog.metrics()["engine_hangs"] == 1 and watchdog.metrics()["engine_deaths"] == 1
    assert watchdog.live() == [engines[0].url]


def test_a_probe_that_overlaps_a_pause_kills_nothing(engines):
    """The pause lands while the probe waits for the hung engine (its handler pauses the watchdog on arrival)."""
    watchdog, requests = None, []

    def pause_on_the_first_request():
        requests.append(1)
        if len(requests) == 1:
            watchdog.pause_probes()

    engines += [StandInEngine(hung=False), StandInEngine(hung=True, on_request=pause_on_the_first_request)]
    servers = StandInServers(engines)
    watchdog = EngineWatchdog(servers, interval_s=3600, on_live_change=lambda urls: None, hang_timeout_s=0.5)
    assert watchdog.probe() == []
    watchdog.resume_probes()  # after the pause: the next probe finds it
    assert watchdog.probe() == [engines[1].url] and servers.killed == [1]


def test_no_probe_while_paused(engines):
    engines += [StandInEngine(hung=True)]
    servers = StandInServers(engines)
    watchdog = EngineWatchdog(servers, interval_s=3600, on_live_change=lambda urls: None, hang_timeout_s=0.5)
    watchdog.pause_probes()
    assert watchdog.probe() == [] and servers.killed == []
