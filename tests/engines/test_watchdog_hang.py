"""The watchdog's hang probe: an engine process that is alive but does not answer `/health_generate` in time is
killed (and so handled as a dead engine); a healthy one is left alone; nothing is killed on the strength of a
`/health_generate` probe that overlapped a pause of the engines (a paused engine does not answer it). While the
engines are paused (a weight sync) the probe is `/model_info`, which a paused engine answers and a frozen one does
not; after a failed sync, a frozen engine is reported lost whether the prober or the sync's failure comes first.

The engines are stand-in HTTP servers behind a stand-in of `EngineServers`: this tests the watchdog's logic, not
SGLang (the crash e2e test runs real engines). A stand-in fails the probed paths it is told to by closing the
connection unanswered, which the watchdog takes as no answer at once; so a test with a healthy engine beside a
failing one has a bound (`BOUND_S`) that the healthy one's answer never races, however loaded the machine (CI once
took 0.7 s to answer one on loopback, against a bound of 0.5 s). The bound itself is tested apart, with an engine
that holds the probe and no other engine to race it."""

from __future__ import annotations

import threading

import httpx
import pytest

from slimish.engines.engine_set import JOINING, EngineSet
from slimish.engines.watchdog import EngineWatchdog
from tests.kit.engines import LoopbackServer

FROZEN = ("/health_generate", "/model_info")  # a stopped process answers nothing
PAUSED = ("/health_generate",)  # a paused engine generates nothing, but its HTTP process answers
BOUND_S = 60.0  # the hang bound where a healthy engine must answer: never reached on loopback


class StandInEngine:
    """An HTTP server on 127.0.0.1 (tests/kit/engines.py's `LoopbackServer`) that answers every GET 200 at once,
    except those to the paths in `hung`: it closes their connection unanswered or, with `holds`, holds them until the
    test sets `release`. `on_request` is called when a `hung` request arrives, before that."""

    def __init__(self, *, hung: tuple[str, ...] = (), holds: bool = False, on_request=None):
        self.hung, self.holds, self.on_request = hung, holds, on_request
        self.release = threading.Event()
        self.server = LoopbackServer(self.answer)
        self.url = self.server.url

    def answer(self, request: httpx.Request) -> httpx.Response | None:
        if request.url.path in self.hung:
            if self.on_request is not None:
                self.on_request()
            if not self.holds:
                return None  # the client sees the connection end with no answer
            self.release.wait(30)
        return httpx.Response(200)

    def close(self):
        self.release.set()
        self.server.close()


class StandInServers:
    """What the watchdog uses of EngineServers; a killed engine stays dead (restarts are not under test)."""

    log_dir = "logs"

    def __init__(self, engines):
        self.engines = engines
        self.engine_urls = [e.url for e in engines]
        self.killed: list[int] = []
        self.exited: set[int] = set()  # processes that died on their own (or by a signal from outside)
        self.respawned: list[int] = []
        self.stopped: dict[int, list[int]] = {}  # engine -> PIDs of its processes in state T (SIGSTOP)

    def engine_alive(self, i):
        return i not in self.killed and i not in self.exited

    def engine_exit_code(self, i):
        return -9

    def engine_stopped(self, i):
        return [] if i in self.killed else self.stopped.get(i, [])

    def kill_engine(self, i):
        self.killed.append(i)

    def router_remove(self, url):
        pass

    def respawn_engine(self, i):
        self.respawned.append(i)

    def wait_engine(self, i):
        raise RuntimeError("not restarted in this test")


def watchdog_of(servers, hang_timeout_s: float = BOUND_S, interval_s: float = 3600) -> EngineWatchdog:
    return EngineWatchdog(servers, EngineSet(servers.engine_urls), interval_s=interval_s,
                          on_live_change=lambda urls: None, hang_timeout_s=hang_timeout_s)


@pytest.fixture
def engines():
    made = []
    yield made
    for engine in made:
        engine.close()


def test_a_hung_engine_is_killed_and_handled_as_dead(engines):
    engines += [StandInEngine(), StandInEngine(hung=FROZEN)]
    servers = StandInServers(engines)
    watchdog = watchdog_of(servers)
    assert watchdog.probe() == [engines[1].url]
    assert servers.killed == [1] and servers.respawned == [1]
    assert watchdog.metrics()["engine_hangs"] == 1 and watchdog.metrics()["engine_deaths"] == 1
    assert watchdog.live() == [engines[0].url]


def test_an_engine_that_holds_the_probe_past_the_bound_is_hung(engines, caplog):
    """The bound: the probe gives up on an engine that holds it. It is alone, so no answer races the timer."""
    engines += [StandInEngine(hung=FROZEN, holds=True)]
    servers = StandInServers(engines)
    assert watchdog_of(servers, hang_timeout_s=0.5).probe() == [engines[0].url]
    assert servers.killed == [0] and "/health_generate gave no answer (ReadTimeout)" in caplog.text


def test_an_engine_that_died_is_a_death_not_a_hang(engines):
    """Killed from outside just before the probe: its port refuses the probe at once. Counted once, as a death
    (the crash e2e test's fault 1 was once counted as a hang too, when the probe came first)."""
    engines += [StandInEngine(), StandInEngine()]
    servers = StandInServers(engines)
    watchdog = watchdog_of(servers)
    engines[1].close()
    servers.exited.add(1)
    assert watchdog.probe() == [] and servers.killed == []
    assert watchdog.metrics()["engine_hangs"] == 0 and watchdog.metrics()["engine_deaths"] == 1
    assert servers.respawned == [1] and watchdog.live() == [engines[0].url]


def test_a_probe_that_overlaps_a_pause_kills_nothing(engines):
    """The pause lands while the probe waits for the hung engine (its handler pauses the watchdog on arrival)."""
    watchdog, requests = None, []

    def pause_on_the_first_request():
        requests.append(1)
        if len(requests) == 1:
            watchdog.pause_probes()

    engines += [StandInEngine(), StandInEngine(hung=FROZEN, on_request=pause_on_the_first_request)]
    servers = StandInServers(engines)
    watchdog = watchdog_of(servers)
    assert watchdog.probe() == []
    watchdog.resume_probes()  # after the pause: the next probe finds it
    assert watchdog.probe() == [engines[1].url] and servers.killed == [1]


def test_while_paused_a_frozen_engine_is_killed_and_a_paused_one_is_not(engines):
    engines += [StandInEngine(hung=PAUSED), StandInEngine(hung=FROZEN)]
    servers = StandInServers(engines)
    watchdog = watchdog_of(servers)
    watchdog.pause_probes()
    assert watchdog.probe() == [engines[1].url]
    assert servers.killed == [1] and watchdog.metrics()["engine_hangs"] == 1


def test_after_a_failed_sync_a_frozen_engine_is_lost_though_no_probe_found_it(engines):
    """The sync failed before the prober's next round: the watchdog probes the sync's engines itself."""
    engines += [StandInEngine(hung=PAUSED), StandInEngine(hung=FROZEN)]
    servers = StandInServers(engines)
    watchdog = watchdog_of(servers)
    watchdog.pause_probes()
    urls = [e.url for e in engines]
    assert watchdog.lost_after_failure(urls, wait_s=0) == [engines[1].url]
    assert servers.killed == [1] and watchdog.metrics()["engine_hangs"] == 1


def test_after_a_failed_sync_an_engine_the_prober_killed_is_lost_and_counted_once(engines):
    engines += [StandInEngine(), StandInEngine(hung=FROZEN)]
    servers = StandInServers(engines)
    watchdog = watchdog_of(servers)
    watchdog.pause_probes()
    assert watchdog.probe() == [engines[1].url]
    assert watchdog.lost_after_failure([e.url for e in engines], wait_s=0) == [engines[1].url]
    assert servers.killed == [1]
    assert watchdog.metrics()["engine_hangs"] == 1 and watchdog.metrics()["engine_deaths"] == 1


def test_a_sync_that_failed_with_every_engine_answering_lost_none(engines):
    engines += [StandInEngine(hung=PAUSED), StandInEngine(hung=PAUSED)]
    servers = StandInServers(engines)
    watchdog = watchdog_of(servers)
    watchdog.pause_probes()
    assert watchdog.lost_after_failure([e.url for e in engines], wait_s=0) == []
    assert servers.killed == []


def test_a_joining_engine_that_dies_is_restarted_again(engines):
    """A restarted engine waiting to join (at the next sync) is watched like a live one."""
    engines += [StandInEngine(), StandInEngine()]
    servers = StandInServers(engines)
    watchdog = watchdog_of(servers)
    watchdog.engines.set(engines[1].url, JOINING)
    servers.killed.append(1)  # it died on its own
    watchdog.check()
    assert servers.respawned == [1] and watchdog.lost([engines[1].url]) == [engines[1].url]


def test_a_pause_until_idle_waits_for_the_generate_probe_on_its_way(engines):
    """Before colocated engines release their memory they must run no request of the watchdog's: a pause with
    `until_idle` returns only after the `/health_generate` probe already sent has ended (here held by the engine
    until the test lets it go), and the probes after it ask `/model_info`."""
    arrived = threading.Event()
    engines += [StandInEngine(hung=PAUSED, holds=True, on_request=arrived.set)]
    watchdog = watchdog_of(StandInServers(engines))
    probing = threading.Thread(target=watchdog.probe)
    probing.start()
    assert arrived.wait(30), "the probe reached the engine"
    pausing = threading.Thread(target=watchdog.pause_probes, kwargs={"until_idle": True})
    pausing.start()
    pausing.join(0.5)
    assert pausing.is_alive(), "the pause waits while the probe is on its way"
    engines[0].release.set()
    probing.join(30)
    pausing.join(30)
    assert not pausing.is_alive()
    engines[0].release.clear()
    assert watchdog.probe() == [], "paused, the probe is /model_info, which the engine answers at once"


def test_an_engine_whose_processes_stay_stopped_is_killed_without_a_probe(engines, caplog):
    """A frozen engine (SIGSTOP: state T in /proc) is found by the process state, which needs no answer from it and
    so also holds while it is busy loading weights: stopped at two checks, it is killed and counted as a hang, and
    the next check handles its death. No probe is sent (its HTTP server answers everything here)."""
    engines += [StandInEngine(), StandInEngine()]
    servers = StandInServers(engines)
    watchdog = watchdog_of(servers, interval_s=0)
    servers.stopped[1] = [4242]
    watchdog.check()
    assert servers.killed == [], "a stop seen once may be a moment's"
    watchdog.check()
    assert servers.killed == [1] and f"engine {engines[1].url} is frozen" in caplog.text
    watchdog.check()
    assert watchdog.metrics()["engine_hangs"] == 1 and watchdog.metrics()["engine_deaths"] == 1
    assert servers.respawned == [1] and watchdog.live() == [engines[0].url]


def test_an_engine_stopped_for_one_check_only_is_left_alone(engines):
    engines += [StandInEngine()]
    servers = StandInServers(engines)
    watchdog = watchdog_of(servers, interval_s=0)
    servers.stopped[0] = [4242]
    watchdog.check()
    servers.stopped[0] = []  # continued
    watchdog.check()
    servers.stopped[0] = [4242]  # stopped again: a new first sighting
    watchdog.check()
    assert servers.killed == [] and watchdog.metrics()["engine_hangs"] == 0


def test_an_engine_that_missed_a_bucket_deadline_is_killed_though_it_answers(engines):
    """A weight sync found it hung (no answer to a bucket by the bucket's deadline) while it answers /model_info, as
    an engine whose GPU stream is stuck in a collective would: killed, counted as a hang, restarted."""
    engines += [StandInEngine(), StandInEngine()]
    servers = StandInServers(engines)
    watchdog = watchdog_of(servers)
    assert watchdog.kill_hung([engines[1].url]) == [engines[1].url]
    assert servers.killed == [1] and servers.respawned == [1]
    assert watchdog.metrics()["engine_hangs"] == 1 and watchdog.metrics()["engine_deaths"] == 1
    assert watchdog.kill_hung([engines[1].url]) == [engines[1].url] and servers.killed == [1], "killed once"
