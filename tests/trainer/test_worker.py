"""The Megatron trainer worker on CPU/gloo: SFT learns, RL logprobs are exact, GRPO moves the right way."""

from __future__ import annotations

import pytest
import torch

from slimish.config import load_config
from slimish.sample import Sample
from tests.conftest import REPO
from tests.trainer.worker_rank import response_logprobs


@pytest.fixture(scope="module")
def worker(task_assets, megatron_world):
    from slimish.trainer.worker import TrainerWorker

    cfg = load_config(REPO / "configs/quickstart_cpu.yaml", [
        f"model.hf_path={task_assets['model']}", f"data.path={task_assets['train']}",
        f"sft.data_path={task_assets['sft']}", "trainer.micro_batch_size=4", "trainer.optimizer.lr=0.01"])
    w = TrainerWorker(cfg, rank=0, world_size=1)
    w.setup(master_addr="unused", master_port=0)  # the process group already exists (megatron_world)
    return w


def _samples(n=8, response=(23, 0)):
    return [Sample(group_id=i // 4, index=i % 4, prompt="say 7", prompt_ids=[269, 221, 23 + (i % 3)],
                   response_ids=list(response), rollout_logprobs=[0.0] * len(response),
                   weight_versions=[0] * len(response), loss_mask=[1] * len(response)) for i in range(n)]


def _response_logprobs(worker, samples):
    """Per-sample sum of the trainer's response logprobs."""
    return response_logprobs(worker, samples).sum(dim=1)


def test_sft_reduces_loss(worker):
    samples = _samples()
    first = worker.sft_step(samples)["sft_loss"]
    for _ in range(3):
        last = worker.sft_step(samples)["sft_loss"]
    assert last < first


def test_engine_logprobs_are_matched_and_first_ppo_kl_is_exactly_zero(worker):
    samples = _samples()
    exact = _response_logprobs(worker, samples)
    for s in samples:  # pretend the engine returned exactly what the trainer computes
        s.rollout_logprobs = [float(exact[0]) / 2] * 2
    metrics = worker.compute_logprobs(samples)
    assert metrics["logprob_abs_diff_max"] >= 0.0
    out = worker.train([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.5, -0.5])
    assert out["ppo_kl"] == 0.0, "same weights, same micro-batches: the ratio must be exactly 1"


def test_grpo_step_raises_logprob_of_positive_advantage(worker):
    samples = _samples()
    before = _response_logprobs(worker, samples)
    advantages = [1.0, -1.0, -1.0, -1.0, 1.0, -1.0, -1.0, -1.0]
    worker.compute_logprobs(samples)
    worker.train(advantages)
    after = _response_logprobs(worker, samples)
    change = after - before
    adv = torch.tensor(advantages)
    assert change[adv > 0].mean() > change[adv < 0].mean()


def test_kl_to_reference_starts_at_zero_and_grows(task_assets, megatron_world):
    from slimish.trainer.worker import TrainerWorker

    cfg = load_config(REPO / "configs/quickstart_cpu.yaml", [
        f"model.hf_path={task_assets['model']}", f"data.path={task_assets['train']}",
        f"sft.data_path={task_assets['sft']}", "trainer.micro_batch_size=8", "trainer.optimizer.lr=0.05",
        "trainer.loss.kl_coef=0.1"])
    w = TrainerWorker(cfg, rank=0, world_size=1)
    w.setup(master_addr="unused", master_port=0)
    assert w.ref_model is not None
    advantages = [1.0, -1.0, -1.0, -1.0, 1.0, -1.0, -1.0, -1.0]
    w.compute_logprobs(_samples())
    first = w.train(advantages)
    w.compute_logprobs(_samples())
    second = w.train(advantages)
    assert first["kl_ref"] == 0.0
    assert second["kl_ref"] > 0.0
