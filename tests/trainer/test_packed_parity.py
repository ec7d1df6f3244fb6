"""Packed micro-batches (several samples in one row, block-diagonal mask, positions restarting) with logits made a
few tokens at a time give the trainer the same logprobs, loss and gradient as one right-padded sample per row with
the whole sequence's logits at once; the policy entropy it reports is that of the HF model."""

from __future__ import annotations

import pytest
import torch

from slimish.sample import Sample
from slimish.trainer import rl_step as steps
from tests.kit.samples import sample
from tests.kit.trainer import logprobs_by_sample, make_worker, rl_step, task_overrides


def _worker(task_assets, *overrides):
    """Needs the `megatron_world` fixture (the process group already exists)."""
    return make_worker(*task_overrides(task_assets), "trainer.optimizer.lr=0.01", "trainer.micro_batch_size=2",
                       "rollout.temperature=0.8", *overrides)


def _samples() -> list[Sample]:
    """8 samples of 4 to 13 tokens (prompts of 2-4, responses of 1-9), so rows pack two to four samples."""
    out = []
    for i in range(8):
        prompt = [269, 221, 23, 24][: 2 + i % 3]
        response = [(23 + i * 7 + t) % 90 for t in range(1 + (i * 5) % 9)]
        out.append(sample(group_id=i // 4, index=i % 4, prompt_ids=prompt, response_ids=response))
    return out


ADVANTAGES = [1.0, -1.0, -0.5, 0.5, 0.25, -0.25, 1.5, -1.5]


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_packed_step_equals_padded_step(task_assets, megatron_world, aggregation):
    padded = _worker(task_assets, f"trainer.loss.token_aggregation={aggregation}")
    packed = _worker(task_assets, f"trainer.loss.token_aggregation={aggregation}",
                     "trainer.max_tokens_per_micro_batch=24", "trainer.logprob_chunk_tokens=5")
    samples = _samples()
    before = [logprobs_by_sample(w, samples) for w in (padded, packed)]
    for a, b in zip(*before):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert len(steps.plan(packed.step, samples, 1)[0][0]) < len(steps.plan(padded.step, samples, 1)[0][0]), \
        "rows hold several samples"
    metrics = []
    for w in (padded, packed):
        metrics.append(rl_step(w, samples, ADVANTAGES))
    for key in ("pg_loss", "grad_norm", "clip_frac"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-5, abs=1e-6), key
    assert metrics[1]["ppo_kl"] == 0.0
    # After the step, as between parallel layouts: Adam turns reduction-order noise in near-zero grads into ~1e-5.
    for a, b in zip(*[logprobs_by_sample(w, samples) for w in (padded, packed)]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_entropy_is_the_policy_entropy_over_trained_tokens(task_assets, megatron_world):
    from transformers import AutoModelForCausalLM

    worker = _worker(task_assets, "trainer.max_tokens_per_micro_batch=24", "trainer.logprob_chunk_tokens=3")
    hf = AutoModelForCausalLM.from_pretrained(task_assets["model"], dtype=torch.float32)
    samples = _samples()
    entropies = []
    with torch.no_grad():
        for sample in samples:
            logits = hf(torch.tensor([sample.tokens])).logits[0, len(sample.prompt_ids) - 1:-1] / 0.8
            entropies.append(torch.distributions.Categorical(logits=logits).entropy())
    expected = torch.cat(entropies).mean().item()
    assert steps.prepare(worker.step, samples)[1]["entropy"] == pytest.approx(expected, abs=1e-5)
