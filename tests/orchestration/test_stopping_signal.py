"""The signal a stopped job names and exits with (128 + it): SIGTERM's, also when it landed while the driver waited
in `ray.get`, which turns the Terminated raised in its wait into a plain KeyboardInterrupt (checked with Ray 2.60.0
here: a SIGTERM 3 s into a `ray.get` of a 30 s task came out as KeyboardInterrupt without its signal number; the
engine-crash e2e test's job, SIGTERMed at whatever point it is in, must exit 143)."""

from __future__ import annotations

import os
import signal

import pytest

from slimish.orchestration import graceful_stop


@pytest.fixture
def sigterm_raises():
    previous = signal.signal(signal.SIGTERM, graceful_stop.raise_terminated)
    graceful_stop.TERMINATED_BY.clear()
    yield
    signal.signal(signal.SIGTERM, previous)
    graceful_stop.TERMINATED_BY.clear()


def test_sigterm_is_named_as_itself(sigterm_raises):
    with pytest.raises(KeyboardInterrupt) as caught:
        os.kill(os.getpid(), signal.SIGTERM)
    assert graceful_stop.stopping_signal(caught.value) == signal.SIGTERM


def test_sigterm_whose_exception_was_replaced_on_the_way_is_still_sigterm(sigterm_raises):
    with pytest.raises(KeyboardInterrupt) as caught:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except KeyboardInterrupt:
            raise KeyboardInterrupt from None  # what ray.get does with it
    assert not hasattr(caught.value, "signum")
    assert graceful_stop.stopping_signal(caught.value) == signal.SIGTERM


def test_ctrl_c_is_sigint(sigterm_raises):
    assert graceful_stop.stopping_signal(KeyboardInterrupt()) == signal.SIGINT
