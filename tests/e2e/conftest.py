"""The e2e tier's shared engines (tests/e2e/shared_engines.py)."""

from __future__ import annotations

import pytest

from tests.e2e import shared_engines


@pytest.fixture(scope="session")
def engine_pool(task_assets, tmp_path_factory):
    """Two engines on the session's tiny model, for the whole session (started at the first test that asks)."""
    engines = shared_engines.start(task_assets["model"], tmp_path_factory.mktemp("shared_engines"))
    yield engines
    engines.stop()


@pytest.fixture
def attached(engine_pool):
    """The shared engines, checked healthy and generating before and after the test that attaches a job to them."""
    engine_pool.check_engines()
    yield engine_pool
    engine_pool.check_engines()
