"""The e2e tier's shared engines (tests/e2e/shared_engines.py)."""

from __future__ import annotations

import pytest

from tests.e2e import shared_engines


@pytest.fixture(scope="package")
def engine_pool(task_assets, tmp_path_factory):
    """Two engines on the session's tiny model, from the first test of tests/e2e that asks to the end of tests/e2e
    (stopped before the tiers that follow, which need no engines)."""
    engines = shared_engines.start(task_assets["model"], tmp_path_factory.mktemp("shared_engines"))
    yield engines
    engines.stop()


@pytest.fixture
def attached(engine_pool):
    """The shared engines, checked healthy and generating before and after the test that attaches a job to them.
    A check that finds one broken mends it first, so one test's failure is not every later test's."""
    engine_pool.check_engines("before the test")
    yield engine_pool
    engine_pool.check_engines("after the test")
