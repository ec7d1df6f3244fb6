"""run.wandb_project: every step's metrics also go to a real Weights & Biases run (offline mode: files under the run
directory, as `wandb sync` uploads them later), and a resumed job continues the same W&B run.

What resuming means is read from the runs' own data files, not from their directory names: W&B names an offline
run's directory by the second it started (and adds "-1" when a resume starts within the same second), so how many
directories there are and what they are called is a fact about the clock."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from slimish.orchestration.metrics import MetricsLogger

BLOCK = 32 * 1024  # the LevelDB log block W&B writes its .wandb files in
HEADER = 7         # ":W&B", a 2-byte magic, a version byte; each record's header is also 7 bytes
FULL, LAST = 1, 4  # LevelDB record types that end a record (FIRST and MIDDLE continue it)


def wandb_records(path: Path):
    """The protobuf Records of one offline .wandb file (no reader ships in the wandb package: its core is Go)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B data file"
    pos, pieces = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # the rest of a block too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        pieces += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def offline_segments(run: Path) -> list[dict]:
    """Each offline run segment under run/wandb: its run id and {step: metrics} from its history records."""
    segments = []
    for path in sorted((run / "wandb").glob("offline-run-*/*.wandb")):
        run_ids, history = set(), {}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_ids.add(record.run.run_id)
            elif kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                history[items.pop("_step")] = items
        segments.append({"run_ids": run_ids, "history": history})
    return segments


@pytest.fixture()
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))


@pytest.fixture(params=["clock", "same_second"])
def start_second(request, monkeypatch):
    """The clock as it is, and every W&B run starting in one second: the case that made the old directory-count
    assertion fail one run in four (a resume within the second the first segment started)."""
    if request.param == "same_second":
        from wandb.sdk import wandb_settings

        monkeypatch.setattr(wandb_settings.Settings, "_start_datetime", property(lambda self: "20260101_000000"))
    return request.param


def test_metrics_go_to_an_offline_wandb_run_that_a_resume_continues(offline, start_second, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    logger = MetricsLogger(run, wandb_project="slimish-test", run_name="r", config={"rl": {"num_steps": 2}})
    logger.log(1, {"reward_mean": 0.25, "status": "ok"})
    logger.log(2, {"reward_mean": 0.5})
    logger.close()
    run_id = (run / "wandb_id").read_text().strip()
    resumed = MetricsLogger(run, resume_after=2, wandb_project="slimish-test", run_name="r")
    resumed.log(3, {"reward_mean": 0.75})
    resumed.close()

    assert (run / "wandb_id").read_text().strip() == run_id
    segments = offline_segments(run)
    # Two segments of the same W&B run, nothing overwritten: steps 1-2 in the first, the resumed step 3 in the second
    assert [s["run_ids"] for s in segments] == [{run_id}, {run_id}]
    histories = sorted((s["history"] for s in segments), key=min)
    assert [sorted(h) for h in histories] == [[1, 2], [3]]
    assert [histories[0][1]["reward_mean"], histories[0][2]["reward_mean"], histories[1][3]["reward_mean"]] == \
        [0.25, 0.5, 0.75]
    assert "status" not in histories[0][1], "only numbers go to W&B"
