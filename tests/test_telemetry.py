"""GPU telemetry degrades to nothing without a GPU driver, saying so in one log line (this machine has none)."""

from __future__ import annotations

import logging

from slimish.telemetry import GpuTelemetry


def test_without_a_driver_telemetry_is_empty_after_one_log_line(caplog):
    with caplog.at_level(logging.DEBUG, logger="slimish.telemetry"):
        telemetry = GpuTelemetry("trainer0")
        assert telemetry.sample() == {} and telemetry.sample() == {}
    lines = [r.getMessage() for r in caplog.records if r.name == "slimish.telemetry"]
    assert len(lines) == 1 and lines[0].startswith("GPU telemetry off for trainer0: ")
