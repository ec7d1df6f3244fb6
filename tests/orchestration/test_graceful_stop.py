"""SIGTERM / SIGUSR1 as a stop request (slimish/orchestration/graceful_stop.py) and the driver's safe point
(`RLJob.stop_if_asked`). The job-level behaviour (a SIGTERMed job saves its step and exits 75; a requeued Slurm job
resumes from it) is in tests/e2e/test_engine_crash.py and tests/slurm/test_sbatch.py."""

from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace

import pytest

from slimish.orchestration.graceful_stop import GracefulStop, StoppedOnSignal, Terminated


@pytest.fixture
def restore_handlers():
    previous = {s: signal.getsignal(s) for s in GracefulStop.SIGNALS}
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def test_the_first_signal_is_a_request_and_repeats_are_the_same_request(restore_handlers):
    stop = GracefulStop(enabled=True, grace_s=3600)
    stop.install()
    os.kill(os.getpid(), signal.SIGUSR1)  # Python runs the handler before the next bytecode of this thread
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested == signal.SIGUSR1
    stop.cancel()


def test_past_the_grace_the_main_thread_is_interrupted(restore_handlers):
    stop = GracefulStop(enabled=True, grace_s=0.2)
    stop.install()
    os.kill(os.getpid(), signal.SIGTERM)
    never = threading.Event()
    with pytest.raises(Terminated) as caught:
        never.wait(60)  # a step that does not end: the grace timer's SIGTERM interrupts the wait
    assert caught.value.signum == signal.SIGTERM


@pytest.mark.parametrize("enabled", [True, False], ids=["while-starting", "disabled"])
def test_sigterm_interrupts_at_once_while_starting_or_when_disabled(restore_handlers, enabled):
    stop = GracefulStop(enabled=enabled, grace_s=3600)
    stop.install_immediate() if enabled else stop.install()
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signum)
            threading.Event().wait(60)
    assert stop.requested is None


def _job(tmp_path, requested):
    from slimish.orchestration.driver import RLJob

    said, saved = [], []
    job = SimpleNamespace(stop=SimpleNamespace(requested=requested, waited_s=lambda: 2.0), say=said.append,
                          run_dir=tmp_path, lineage="r1", said=said, saved=saved,
                          save_checkpoint=lambda step, elapsed, upcoming: saved.append(step),
                          finish_checkpoint=lambda: None)
    return job, lambda step, **kw: RLJob.stop_if_asked(job, step, **kw)


def test_a_safe_point_without_a_request_does_nothing(tmp_path):
    job, stop_if_asked = _job(tmp_path, None)
    stop_if_asked(3, saved=False)
    assert job.said == [] and job.saved == []


def test_a_request_saves_the_step_unless_it_was_just_saved(tmp_path):
    job, stop_if_asked = _job(tmp_path, signal.SIGTERM)
    with pytest.raises(StoppedOnSignal, match=r"^stopped by SIGTERM after step 3; no checkpoint yet") as caught:
        stop_if_asked(3, saved=False)  # (the stand-in save writes nothing, so there is none to name)
    assert job.saved == [3] and caught.value.saved
    assert job.said == ["SIGTERM 2s ago: stopping after step 3, saving it first"]
    job, stop_if_asked = _job(tmp_path, signal.SIGUSR1)
    with pytest.raises(StoppedOnSignal, match="stopped by SIGUSR1 after step 4") as caught:
        stop_if_asked(4, saved=True)
    assert job.saved == [] and not caught.value.saved
