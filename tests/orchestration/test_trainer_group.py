"""TrainerGroup.call_all puts its arguments in Ray's object store once, whatever the number of ranks (a real local
Ray, in a process of its own)."""

from __future__ import annotations

from tests.orchestration.ray_probe import run_probe


def test_a_call_to_every_rank_pickles_its_arguments_once():
    out = run_probe("call_all_probe.py")
    assert "results=[('Payload', 7), ('Payload', 7), ('Payload', 7)] pickled=1" in out, out
