"""run.wandb_project: every step's metrics also go to a real Weights & Biases run (offline mode: files under the run
directory, as `wandb sync` uploads them later), and a resumed job continues the same W&B run."""

from __future__ import annotations

import pytest

from slimish.orchestration.metrics import MetricsLogger


@pytest.fixture()
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))


def test_metrics_go_to_an_offline_wandb_run_that_a_resume_continues(offline, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    logger = MetricsLogger(run, wandb_project="slimish-test", run_name="r", config={"rl": {"num_steps": 2}})
    logger.log(1, {"reward_mean": 0.25, "status": "ok"})
    logger.log(2, {"reward_mean": 0.5})
    logger.close()
    run_id = (run / "wandb_id").read_text().strip()
    offline_runs = list((run / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline_runs) == 1 and list(offline_runs[0].glob("*.wandb")), "the run's data file"
    resumed = MetricsLogger(run, resume_after=2, wandb_project="slimish-test", run_name="r")
    resumed.log(3, {"reward_mean": 0.75})
    resumed.close()
    assert (run / "wandb_id").read_text().strip() == run_id
    assert len(list((run / "wandb").glob(f"offline-run-*-{run_id}"))) == 2  # the same id, resumed
