"""The engine set: states, one claim per death, what a weight sync goes to, and the signal a waiter gets."""

from __future__ import annotations

import threading

import pytest

from slimish.engines.engine_set import FAILED, JOINING, LIVE, RESTARTING, EngineSet, NoEngineLeft

A, B = "http://a:1", "http://b:2"


def test_a_death_is_claimed_once_and_a_restarted_engine_joins_at_the_next_sync():
    engines = EngineSet([A, B])
    assert engines.for_sync() == {"urls": [A, B], "joining": []}
    assert engines.claim(B, RESTARTING, count="deaths") and not engines.claim(B, RESTARTING, count="deaths")
    assert engines.live() == [A] and engines.lost([A, B]) == [B] and engines.metrics()["engine_deaths"] == 1
    engines.set(B, JOINING, count="restarts")
    assert engines.for_sync() == {"urls": [A, B], "joining": [B]} and engines.live() == [A]
    engines.set(B, LIVE)
    assert engines.metrics() == {"engines_live": 2, "engine_deaths": 1, "engine_hangs": 0, "engine_restarts": 1,
                                 "engine_restart_failures": 0}


def test_no_engine_left_says_so():
    engines = EngineSet([A])
    engines.set(A, FAILED, count="failures")
    with pytest.raises(NoEngineLeft, match="no SGLang engine is left"):
        engines.for_sync()


def test_a_waiter_wakes_at_the_change_it_waits_for():
    engines = EngineSet([A, B])
    claimed = threading.Event()

    def watcher():
        claimed.wait()
        engines.claim(A, RESTARTING, count="deaths")

    thread = threading.Thread(target=watcher)
    thread.start()
    assert not engines.wait_for(lambda: bool(engines.lost([A])), timeout_s=0.05)  # nothing changed yet
    claimed.set()
    assert engines.wait_for(lambda: bool(engines.lost([A])), timeout_s=30)
    thread.join()
