"""The Megatron trainer worker on CPU/gloo: SFT learns, RL logprobs are exact, GRPO moves the right way."""

from __future__ import annotations

import pytest
import torch

from slimish.sample import Sample, Status
from slimish.trainer import rl_step as steps
from tests.kit import samples as kit_samples
from tests.kit import trainer as kit
from tests.kit.trainer import response_logprobs, rl_step


def make_worker(task_assets, *overrides: str):
    """A one-rank TrainerWorker on the quickstart config and the task's tiny model, with `overrides`; needs the
    `megatron_world` fixture (the process group already exists)."""
    return kit.make_worker(*kit.task_overrides(task_assets), *overrides)


def hf_response_logprobs(hf, sample: Sample, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(HF logits / temperature) of each of `sample`'s response tokens (with autograd, if enabled)."""
    logits = hf(torch.tensor([sample.tokens])).logits[0, len(sample.prompt_ids) - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.response_ids)[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def worker(task_assets, megatron_world):
    return make_worker(task_assets, "trainer.micro_batch_size=4", "trainer.optimizer.lr=0.01")


def _samples(n=8, response=(23, 0)):
    return [kit_samples.sample(group_id=i // 4, index=i % 4, prompt="say 7", prompt_ids=[269, 221, 23 + (i % 3)],
                               response_ids=response) for i in range(n)]


def _response_logprobs(worker, samples):
    """Per-sample sum of the trainer's response logprobs."""
    return response_logprobs(worker, samples)[0].sum(dim=1)


def test_sft_reduces_loss(worker):
    samples = _samples()
    first = worker.sft_step(samples)["sft_loss"]
    for _ in range(3):
        last = worker.sft_step(samples)["sft_loss"]
    assert last < first


def test_engine_logprobs_are_matched_and_first_ppo_kl_is_exactly_zero(worker):
    samples = _samples()
    exact, _ = response_logprobs(worker, samples)
    for sample, row in zip(samples, exact):  # the engine returned exactly what the trainer computes...
        sample.rollout_logprobs = row.tolist()
    samples[3].rollout_logprobs[1] += 0.25   # ...but for one token
    out = rl_step(worker, samples, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.5, -0.5])
    assert out["logprob_abs_diff_max"] == pytest.approx(0.25, abs=1e-6)
    assert out["logprob_abs_diff_mean"] == pytest.approx(0.25 / 16, abs=1e-6)
    assert out["ppo_kl"] == 0.0, "same weights, same micro-batches: the ratio must be exactly 1"


def test_grpo_step_raises_logprob_of_positive_advantage(worker):
    samples = _samples()
    before = _response_logprobs(worker, samples)
    advantages = [1.0, -1.0, -1.0, -1.0, 1.0, -1.0, -1.0, -1.0]
    rl_step(worker, samples, advantages)
    after = _response_logprobs(worker, samples)
    change = after - before
    adv = torch.tensor(advantages)
    assert change[adv > 0].mean() > change[adv < 0].mean()


def test_kl_to_reference_starts_at_zero_and_grows(task_assets, megatron_world):
    w = make_worker(task_assets, "trainer.micro_batch_size=8", "trainer.optimizer.lr=0.05",
                    "trainer.loss.kl_coef=0.1")
    assert w.step.reference is not None
    advantages = [1.0, -1.0, -1.0, -1.0, 1.0, -1.0, -1.0, -1.0]
    first = rl_step(w, _samples(), advantages)
    second = rl_step(w, _samples(), advantages)
    assert first["kl_ref"] == 0.0
    assert second["kl_ref"] > 0.0


def test_token_logprobs_are_of_the_temperature_scaled_distribution(megatron_world):
    """log softmax(logits / T), as SGLang samples and reports them, at several temperatures; the logits are left as
    they were (the cross-entropy kernel works in place)."""
    from slimish.trainer.logprobs import token_logprobs

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 13, generator=gen) * 3
    tokens = torch.randint(0, 13, (2, 6), generator=gen)
    for batch in (logits, logits[:1]):  # one row: the sliced logits are contiguous, the kernel must get a copy
        kept = batch.clone()
        for temperature in (0.3, 0.7, 1.0, 1.6):
            scaled = batch[:, :-1].double() / temperature
            by_hand = scaled.gather(-1, tokens[: len(batch), 1:, None]).squeeze(-1) - scaled.logsumexp(dim=-1)
            got = token_logprobs(batch, tokens[: len(batch)], temperature=temperature)
            torch.testing.assert_close(got.double(), by_hand, atol=1e-5, rtol=0)
            assert torch.equal(batch, kept)


def test_worker_logprobs_follow_the_sampling_temperature(task_assets, megatron_world):
    """At rollout.temperature 0.7 the trainer's old logprobs equal log softmax(HF logits / 0.7) of the same model,
    the distribution the engines sample from; at temperature 1 they would differ by far more than the tolerance."""
    from transformers import AutoModelForCausalLM

    w = make_worker(task_assets, "trainer.micro_batch_size=4", "rollout.temperature=0.7")
    hf = AutoModelForCausalLM.from_pretrained(task_assets["model"], dtype=torch.float32)
    samples = _samples()
    untempered = []
    with torch.no_grad():
        for sample in samples:
            sample.rollout_logprobs = hf_response_logprobs(hf, sample, 0.7).tolist()
            untempered.append(hf_response_logprobs(hf, sample))
    _, metrics = steps.prepare(w.step, samples)
    assert metrics["logprob_abs_diff_max"] <= 1e-5
    tempered = torch.tensor([s.rollout_logprobs for s in samples])
    assert (tempered - torch.stack(untempered)).abs().max() > 1e-2, "the test's temperature makes no difference"


def test_a_sample_that_does_not_train_reaches_no_loss_term(worker):
    """A sample failed after an earlier partial segment keeps its tokens (loss_mask 1) but trains on nothing: with
    token_mean its tokens are not in the normaliser (pg_loss at ratio 1 is -mean advantage of the trained tokens),
    and its mask is 0 in every micro-batch."""
    samples = _samples()
    for sample in samples[4:]:
        sample.status = Status.FAILED
    batch, _ = steps.prepare(worker.step, samples)
    masks = [mb.loss_mask for mbs in batch.microbatches for mb in mbs]
    assert torch.cat(masks).sum(dim=1).tolist() == [2.0] * 4 + [0.0] * 4
    # the estimator gives a failed sample advantage 0
    steps.advantages(worker.step, batch, kit.given_advantages(worker.step.estimator, [1.0] * 4 + [0.0] * 4))
    out = steps.train(worker.step, batch)
    assert out["pg_loss"] == pytest.approx(-1.0, abs=1e-6), "failed samples' tokens diluted the token mean"
    assert out["ppo_kl"] == 0.0


def test_grpo_gradient_is_the_hf_models_gradient_of_the_same_loss(task_assets, megatron_world):
    """The trainer's whole gradient path (chunked logprob head, vocab-parallel cross entropy at a temperature,
    environment tokens masked inside a response, two micro-batches sharing the minibatch's token-mean normaliser) gives
    the gradient HF transformers gives for the same model and loss: the GRPO loss at ratio 1 is
    -sum(advantage * logprob) over trained tokens / their count. Compared by the pre-clip global grad norm."""
    from transformers import AutoModelForCausalLM

    temperature = 0.7
    w = make_worker(task_assets, "trainer.micro_batch_size=4", f"rollout.temperature={temperature}")
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(8):
        length = 3 + i % 4 * 3
        loss_mask = [1] * length
        if i % 2:  # a calculator-like environment span in the middle of the response
            loss_mask[1:3] = [0, 0]
        samples.append(kit_samples.sample(group_id=i // 4, index=i % 4, prompt="say 7",
                                          prompt_ids=[269, 221, 23 + i % 3],
                                          response_ids=torch.randint(1, 300, (length,), generator=gen).tolist(),
                                          loss_mask=loss_mask))
    advantages = [1.5, -0.5, -0.5, -0.5, 0.8, -1.2, 0.8, -0.4]

    hf = AutoModelForCausalLM.from_pretrained(task_assets["model"], dtype=torch.float32)
    trained_tokens = sum(sum(s.loss_mask) for s in samples)
    loss = torch.zeros(())
    for sample, advantage in zip(samples, advantages):
        logprobs = hf_response_logprobs(hf, sample, temperature)
        loss = loss - (advantage * logprobs * torch.tensor(sample.loss_mask, dtype=torch.float32)).sum()
    (loss / trained_tokens).backward()
    hf_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters() if p.grad is not None)).item()

    out = rl_step(w, samples, advantages)
    mean_advantage = sum(a * sum(s.loss_mask) for s, a in zip(samples, advantages)) / trained_tokens
    assert out["pg_loss"] == pytest.approx(-mean_advantage, rel=1e-5)  # the loss's value at ratio 1
    assert out["grad_norm"] == pytest.approx(hf_norm, rel=1e-4)


def test_one_rl_step_is_one_call_that_keeps_nothing(worker):
    """`TrainerWorker.rl_step` is the step's one call: it returns the metrics (with its own phase times) and each
    sample's mean advantage, and no step data outlives it (no batch, micro-batch or sample is left anywhere)."""
    import gc

    from slimish.trainer.batch import MicroBatch
    from slimish.trainer.rollout_batch import RolloutBatch

    def alive() -> tuple[int, int, int]:
        gc.collect()
        objects = gc.get_objects()
        return tuple(sum(isinstance(o, kind) for o in objects) for kind in (RolloutBatch, MicroBatch, Sample))

    attributes = dict(vars(worker))
    samples = _samples()
    for sample, reward in zip(samples, [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]):
        sample.reward = reward
    before = alive()
    out = worker.rl_step(samples, policy_version=0)
    assert set(out) == {"metrics", "advantage_means"}
    assert len(out["advantage_means"]) == 8 and out["metrics"]["grad_norm"] > 0
    assert all(out["metrics"][f"time_{phase}_s"] > 0 for phase in ("logprobs", "advantages", "optimizer"))
    del out
    assert alive() == before, "(batches, micro-batches, samples) alive after the step"
    assert vars(worker).keys() == attributes.keys()
    assert all(vars(worker)[key] is value for key, value in attributes.items()), "the worker kept step state"


def test_megatron_cpu_offload_is_refused_on_a_cpu_trainer(task_assets, megatron_world):
    """trainer.optimizer.cpu_offload moves the optimizer's state from a GPU to host memory: on the CPU it is there
    already, and Megatron's optimizer (offloading what `is_cuda`) would fail its first step. One line, naming the key.
    (It runs on the emulated GPU: tests/trainer/test_emulated_gpu.py.)"""
    from slimish.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^config key 'trainer.optimizer.cpu_offload': moves the optimizer's state "
                                          r"from the GPU to host memory, and this trainer runs on the CPU"):
        make_worker(task_assets, "model.dtype=bfloat16", "trainer.optimizer.distributed=true",
                    "trainer.optimizer.cpu_offload=true")
