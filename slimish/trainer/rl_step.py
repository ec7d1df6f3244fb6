"""One RL step on a trainer rank, as three functions over one `RolloutBatch`:

  prepare(ctx, samples)        -> the batch: this rank's plan, its micro-batches collated in host memory, old (and
                                  reference) logprobs, critic values; and the parity metrics of the step
  advantages(ctx, batch)       -> per-token advantages (and returns) scattered into the batch's micro-batches, by the
                                  estimator; each step sample's mean advantage
  train(ctx, batch)            -> one optimizer step per minibatch; the step's metrics

`TrainerWorker.rl_step` calls the three in order and keeps nothing: the batch lives for one call. Tests call them
one by one (e.g. `advantages` with an estimator of their own). Every rank of a trainer group runs them on the same
samples; each keeps the data-parallel shard that belongs to it. With pipeline parallelism the per-token logprobs and
the losses exist on the last stage only; every stage returns the last stage's metrics (`StepContext.from_last_stage`).
`sft_step` is the supervised step, on the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimish.collectives import all_reduce
from slimish.config.schema import JobConfig
from slimish.sample import Sample
from slimish.trainer import losses
from slimish.trainer.balance import balanced_partition, imbalance
from slimish.trainer.batch import MicroBatch, collate, collate_packed, packed_lengths, split
from slimish.trainer.estimators import Estimator, StepInputs
from slimish.trainer.lr_schedule import current_lr
from slimish.trainer.packing import pack_ranks
from slimish.trainer.rollout_batch import RolloutBatch
from slimish.trainer.schedule import step_applied


@dataclass(frozen=True, kw_only=True)
class StepContext:
    """What a rank's steps run with, fixed once the trainer is set up: the config, the roles (policy; reference model
    and critic when the loss or estimator needs them), the estimator, and this rank's place in the data-parallel and
    pipeline groups."""
    cfg: JobConfig
    policy: object                 # trainer.roles.Policy
    reference: object | None       # trainer.roles.Reference
    critic: object | None          # trainer.critic.Critic
    estimator: Estimator
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: object = None
    pp_size: int = 1
    pp_group: object = None
    pp_last_rank: int = 0
    pad_id: int = 0

    @property
    def temperature(self) -> float:
        # RL logprobs are of the distribution the engines sampled from: softmax(logits / temperature).
        return self.cfg.rollout.temperature

    def dp_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_reduce(tensor, group=self.dp_group)

    def global_sum(self, value: float) -> float:
        return float(self.dp_sum(torch.tensor([value], dtype=torch.float64, device="cpu")).item())

    def from_last_stage(self, metrics: dict) -> dict:
        """The last pipeline stage's `metrics` on every stage (only it sees logprobs and losses)."""
        if self.pp_size == 1:
            return metrics
        import torch.distributed as dist

        box = [metrics]
        dist.broadcast_object_list(box, src=self.pp_last_rank, group=self.pp_group)
        return box[0]


# ------------------------------------------------------------------------------------------------------ the plan
def plan(ctx: StepContext, samples: list[Sample], num_minibatches: int) -> tuple[list[list[list[Sample]]], list[int],
                                                                                  float]:
    """This rank's part of the step: minibatches -> micro-batches (the same split for logprobs and training: bitwise
    ppo_kl), the step indices of its samples in that order, and the step's dp_token_imbalance. Minibatch i is
    samples[i * M:(i + 1) * M] of the whole step, split over the data-parallel ranks balancing tokens
    (`slimish.trainer.balance`), then into micro-batches: packed under trainer.max_tokens_per_micro_batch
    (`slimish.trainer.packing`, the same count on every rank), else micro_batch_size samples each."""
    size = len(samples) // num_minibatches
    budget = ctx.cfg.trainer.max_tokens_per_micro_batch
    chunks_per_minibatch, indices, loads = [], [], [0] * ctx.dp_size
    for first in range(0, size * num_minibatches, size):
        lengths = [len(s.tokens) for s in samples[first:first + size]]
        parts = balanced_partition(lengths, ctx.dp_size)
        for rank, part in enumerate(parts):
            loads[rank] += sum(lengths[i] for i in part)
        mine = [first + i for i in parts[ctx.dp_rank]]
        if budget:
            bins = pack_ranks([[lengths[i] for i in part] for part in parts], budget)[ctx.dp_rank]
            chunks = [[mine[i] for i in b] for b in bins]
        else:
            chunks = split(mine, ctx.cfg.trainer.micro_batch_size)
        if ctx.cfg.parallel.virtual_pipeline > 1:
            # Megatron's interleaved 1F1B runs micro-batches in groups of pipeline_parallel: padding micro-batches
            # (nothing trained) complete the last group. Every rank plans the same count.
            chunks += [[] for _ in range(-len(chunks) % ctx.pp_size)]
        indices += [i for chunk in chunks for i in chunk]
        chunks_per_minibatch.append([[samples[i] for i in chunk] for chunk in chunks])
    return chunks_per_minibatch, indices, imbalance(loads)


def sequence_multiples(cfg: JobConfig) -> tuple[int, int]:
    """(what a micro-batch's row length, what each packed sequence's length must be a multiple of): tensor_parallel
    under sequence parallelism (a rank's tokens split evenly over the tensor-parallel ranks); with context
    parallelism every sequence is cut into 2 x context_parallel equal chunks (each then split by SP)."""
    par = cfg.parallel
    sp = par.tensor_parallel if par.sequence_parallel and par.tensor_parallel > 1 else 1
    if par.context_parallel == 1:
        return sp, 1
    return 2 * par.context_parallel * sp, 2 * par.context_parallel * sp


def collate_minibatch(ctx: StepContext, minibatch: list[list[Sample]], per_token=None) -> list[MicroBatch]:
    """The micro-batches of one minibatch's chunks (`collate_chunk`; `per_token(chunk)`: each one's per-token
    inputs). The interleaved pipeline (parallel.virtual_pipeline > 1) sends activations of one fixed shape from
    chunk to chunk: every micro-batch of the minibatch is then padded to the same rows and length."""
    shape: dict = {}
    if ctx.cfg.parallel.virtual_pipeline > 1:
        row, sequence = sequence_multiples(ctx.cfg)
        if ctx.cfg.trainer.max_tokens_per_micro_batch:
            shape["length"] = max(sum(packed_lengths(chunk, multiple_of=row, sequence_multiple=sequence))
                                  for chunk in minibatch)
        else:
            longest = max((len(s.tokens) for chunk in minibatch for s in chunk), default=1)
            shape["seq_len"] = -(-longest // row) * row
            shape["rows"] = max(len(chunk) for chunk in minibatch)
    return [collate_chunk(ctx, chunk, **shape, **({"per_token": per_token(chunk)} if per_token else {}))
            for chunk in minibatch]


def collate_chunk(ctx: StepContext, chunk: list[Sample], **kwargs) -> MicroBatch:
    """A micro-batch in host memory, pinned when it is to be copied to a GPU; its rows a multiple of
    `sequence_multiples`."""
    row, sequence = sequence_multiples(ctx.cfg)
    if ctx.cfg.trainer.max_tokens_per_micro_batch:
        mb = collate_packed(chunk, pad_id=ctx.pad_id, multiple_of=row, sequence_multiple=sequence, **kwargs)
    else:
        mb = collate(chunk, pad_id=ctx.pad_id, multiple_of=row, **kwargs)
    return mb.pin_memory() if torch.cuda.is_available() else mb


def denominator(ctx: StepContext, mbs: list[MicroBatch], aggregation: str, minibatch_samples: int) -> float:
    """The minibatch's loss normaliser, over every data-parallel rank."""
    if aggregation == "seq_mean":  # samples that train
        return ctx.global_sum(sum(float(mb.trained_samples()) for mb in mbs))
    if aggregation == "constant":  # Dr. GRPO: samples x generation budget, whatever the lengths
        return float(minibatch_samples * ctx.cfg.rollout.max_new_tokens)
    return ctx.global_sum(sum(float(mb.loss_mask.sum()) for mb in mbs))


# -------------------------------------------------------------------------------------------------- the RL step
def prepare(ctx: StepContext, samples: list[Sample], *, policy_version: int | None = None) -> tuple[RolloutBatch,
                                                                                                     dict]:
    """The step's batch on this rank, with old (and reference) logprobs and critic values; and the step's metrics
    so far: parity with the engines' logprobs (`_parity_sums`, over every data-parallel rank's shard), the policy's
    entropy, dp_token_imbalance."""
    chunks, indices, dp_token_imbalance = plan(ctx, samples, ctx.cfg.trainer.num_minibatches)
    batch = RolloutBatch(samples=samples, indices=indices, chunks=chunks, microbatches=[])
    entropy_sum = entropy_tokens = 0.0
    for minibatch in chunks:
        mbs = collate_minibatch(ctx, minibatch, lambda chunk: {"rollout_logprobs": [s.rollout_logprobs
                                                                                    for s in chunk]})
        batch.microbatches.append(mbs)
        logprobs, entropy_sums = ctx.policy.logprobs(mbs, temperature=ctx.temperature, entropy=True)
        for mb, lp in zip(mbs, logprobs):
            mb.old_logprobs = lp
            entropy_tokens += float(mb.loss_mask.sum())
        entropy_sum += sum(entropy_sums)
        if ctx.reference is not None:
            for mb, lp in zip(mbs, ctx.reference.logprobs(mbs, temperature=ctx.temperature)):
                mb.ref_logprobs = lp
        if ctx.critic is not None:
            for mb, values in zip(mbs, ctx.critic.values(mbs)):
                mb.old_values = values
    metrics = _dp_reduced_parity(ctx, _parity_sums(batch, policy_version))
    # Mean entropy of the policy over the tokens it trains on (last stage only, like the logprobs).
    metrics["entropy"] = ctx.global_sum(entropy_sum) / max(ctx.global_sum(entropy_tokens), 1.0)
    return batch, {**ctx.from_last_stage(metrics), "dp_token_imbalance": dp_token_imbalance}


def advantages(ctx: StepContext, batch: RolloutBatch, estimator: Estimator | None = None) -> list[float]:
    """Per-token advantages of this rank's samples by `estimator` (default: trainer.loss.advantage_estimator's,
    `slimish.trainer.estimators`) from the samples' rewards, and the critic's returns when it has them, scattered into
    the batch's micro-batches. Returns each step sample's mean advantage over its trained tokens (0 when none), the
    same on every rank (for run.save_rollouts)."""
    estimator = estimator or ctx.estimator
    samples = batch.samples
    local = batch.local_fields("loss_mask", "old_logprobs", "ref_logprobs", "old_values")  # none off the last stage
    masks = local["loss_mask"]
    indices = batch.indices[:len(masks)]
    inputs = StepInputs(rewards=torch.tensor([s.reward if s.scored else 0.0 for s in samples], device="cpu"),
                        scored=torch.tensor([s.scored for s in samples], device="cpu"),
                        group_size=ctx.cfg.rollout.samples_per_prompt, indices=indices, masks=masks,
                        old=local["old_logprobs"], ref=local["ref_logprobs"], values=local["old_values"],
                        dp_sum=ctx.dp_sum)
    per_token = estimator.advantages(inputs, ctx.cfg.trainer)
    returns = estimator.returns(inputs, ctx.cfg.trainer) if estimator.returns is not None else None
    if batch.on_last_stage:
        batch.scatter("advantages", per_token)
        if returns is not None:
            batch.scatter("returns", returns)
    means = torch.zeros(len(samples), dtype=torch.float64, device="cpu")
    for i, values, mask in zip(indices, per_token, masks):
        means[i] = float((values * mask).sum() / mask.sum().clamp(min=1))
    return ctx.from_last_stage({"means": ctx.dp_sum(means).tolist()})["means"]


def train(ctx: StepContext, batch: RolloutBatch) -> dict:
    """One optimizer step per minibatch of `batch` (after `advantages`), policy and critic, with the loss configured by
    trainer.loss and the estimator (`losses.PolicyLossTerms`). Returns the step's metrics, each aggregated like the
    loss over micro-batches and data-parallel ranks."""
    if batch.on_last_stage and any(mb.advantages is None for mbs in batch.microbatches for mb in mbs):
        raise RuntimeError("rl_step.train needs rl_step.advantages on the same batch first")
    loss_cfg = ctx.cfg.trainer.loss
    terms = losses.PolicyLossTerms.of(loss_cfg, ratio_level=ctx.estimator.ratio_level)
    aggregation = ctx.estimator.aggregation or loss_cfg.token_aggregation
    sums: dict[str, list[float]] = {}
    grad_norms, critic_norms = [], []
    for mbs in batch.microbatches:
        denom = denominator(ctx, mbs, aggregation, batch.minibatch_samples)
        scale = len(mbs) * ctx.dp_size  # Megatron divides by num_microbatches, DDP averages over DP
        for mb in mbs:
            # seq_mean as a token mean with each sample's tokens weighted 1 / its length: the same for a packed
            # row holding several samples as for one sample per row.
            mb.weights = mb.sequence_weights() if aggregation == "seq_mean" else mb.loss_mask
            mb.segments = mb.sample_segments()

        def loss_fn(mb, logprobs, denom=denom, scale=scale):
            out = losses.policy_loss(logprobs=logprobs, old_logprobs=mb.old_logprobs, advantages=mb.advantages,
                                     mask=mb.weights, terms=terms, denom=denom, ref_logprobs=mb.ref_logprobs,
                                     rollout_logprobs=mb.rollout_logprobs, segments=mb.segments)
            return out.loss * scale, out.metrics

        outputs, grad_norm = ctx.policy.step(mbs, loss_fn, temperature=ctx.temperature)
        if ctx.critic is not None:
            # Regression to the estimator's returns, clipped around the values of `prepare`, normalised like the
            # policy loss (token_mean over the same tokens).
            critic_outputs, critic_norm = ctx.critic.train(mbs, denom=denominator(ctx, mbs, "token_mean", len(mbs)),
                                                           scale=scale)
            outputs = [{**o, **c} for o, c in zip(outputs, critic_outputs)]
            critic_norms.append(critic_norm)
        # Each metric is aggregated like the loss, so micro-batches and data-parallel ranks add up.
        for key in (outputs[0] if outputs else {}):
            sums.setdefault(key, []).append(ctx.global_sum(sum(float(o[key]) for o in outputs)))
        grad_norms.append(grad_norm)
    metrics = {key: sum(values) / len(values) for key, values in sums.items()}
    # Optimizer steps not applied (their gradients were not finite: `schedule.optimizer_step`), policy's and
    # critic's: every rank agrees.
    metrics["skipped_steps"] = sum(not step_applied(norm) for norm in grad_norms + critic_norms)
    if critic_norms:
        metrics["critic_grad_norm"] = critic_norms[-1]
    if sums:  # first minibatch: exactly 0 when on-policy; the last shows how far the minibatches went
        metrics["ppo_kl"], metrics["ppo_kl_last"] = sums["ppo_kl"][0], sums["ppo_kl"][-1]
    # lr: the last minibatch's (every rank holds it; not a last-stage value)
    return {**ctx.from_last_stage({**metrics, "grad_norm": grad_norms[-1]}), "lr": current_lr(ctx.policy.optimizer)}


# ------------------------------------------------------------------------------------------------------ SFT
def sft_step(ctx: StepContext, samples: list[Sample]) -> dict:
    """One supervised step: mean token NLL over the loss-masked (response) tokens."""
    (chunks,), _, _ = plan(ctx, samples, num_minibatches=1)
    mbs = collate_minibatch(ctx, chunks)
    denom = denominator(ctx, mbs, "token_mean", len(samples))
    scale = len(mbs) * ctx.dp_size

    def loss_fn(mb, logprobs):
        nll = -(logprobs * mb.loss_mask).sum() / denom
        return nll * scale, {"nll": nll.detach()}

    outputs, grad_norm = ctx.policy.step(mbs, loss_fn, scheduled=False)
    return ctx.from_last_stage({"sft_loss": ctx.global_sum(sum(float(o["nll"]) for o in outputs)),
                                "grad_norm": grad_norm})


# ------------------------------------------------------------------------------------------------------ parity
def _dp_reduced_parity(ctx: StepContext, sums: torch.Tensor) -> dict:
    """Parity metrics over the whole rollout: every data-parallel rank's shard (max of maxima, summed sums)."""
    if ctx.dp_size > 1:
        sums = torch.cat([all_reduce(sums[:, :1], group=ctx.dp_group, op="max"),
                          all_reduce(sums[:, 1:], group=ctx.dp_group)], dim=1)
    (current_max, current_sum, current_n), (_, stale_sum, stale_n) = sums.tolist()
    return {"logprob_abs_diff_max": current_max, "logprob_abs_diff_mean": current_sum / max(current_n, 1),
            "logprob_abs_diff_stale_mean": stale_sum / max(stale_n, 1)}


def _parity_sums(batch: RolloutBatch, policy_version: int | None) -> torch.Tensor:
    """|engine - trainer| logprobs of this rank's loss-masked response tokens, as [[max, sum, count]] for the tokens
    the engines sampled with `policy_version`, the weights the trainer holds now (all tokens when None), and the
    same for the tokens of older versions (partial rollouts), which differ by the policy's change since. Reported
    as logprob_abs_diff_max / _mean and logprob_abs_diff_stale_mean."""
    sums = {"current": [0.0, 0.0, 0], "stale": [0.0, 0.0, 0]}  # max, sum, count
    for minibatch, mbs in zip(batch.chunks, batch.microbatches):
        for chunk, mb in zip(minibatch, mbs):
            if mb.old_logprobs is None:  # not the last pipeline stage
                continue
            for sample, row, (start, end) in zip(chunk, mb.rows, mb.spans):
                diff = (mb.old_logprobs[row, start:end] - mb.rollout_logprobs[row, start:end]).abs()
                mask = mb.loss_mask[row, start:end].bool()
                current = torch.ones_like(mask)
                if policy_version is not None:
                    current = torch.tensor(sample.weight_versions, device=mask.device) == policy_version
                for key, selected in (("current", diff[mask & current]), ("stale", diff[mask & ~current])):
                    if selected.numel():
                        acc = sums[key]
                        acc[0] = max(acc[0], float(selected.max()))
                        acc[1] += float(selected.sum())
                        acc[2] += selected.numel()
    return torch.tensor([sums["current"], sums["stale"]], dtype=torch.float64, device="cpu")
