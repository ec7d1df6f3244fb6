"""The versions `setup.py` asks for are the lock's: a GPU install from setup.py (Python 3.12 containers included)
gets the Megatron-Core release the CPU suite ran on."""

from __future__ import annotations

import re

from tests.conftest import REPO


def _lock() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements/cpu-lock.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line)
        if match:
            pins[match.group(1).lower()] = match.group(2)
    return pins


def test_setup_pins_megatron_core_to_the_locked_release():
    setup = (REPO / "setup.py").read_text()
    assert f'"megatron-core=={_lock()["megatron-core"]}"' in setup
