"""One Megatron trainer process: model, optimizer, logprobs, GRPO/SFT steps, and the sending end of weight sync.

The driver calls, per RL step: `compute_logprobs(samples)` (old + reference logprobs, kept here) ->
`train(advantages)` -> `sync_weights(version)`. Every rank of a trainer group receives the same calls; each keeps
the data-parallel shard of the samples that belongs to it. With pipeline parallelism the per-token logprobs and the
loss exist on the last stage only; every stage returns the last stage's metrics.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import torch

from slimish.collectives import all_reduce
from slimish.config.schema import JobConfig
from slimish.megatron_bridge.bridge import load_hf_weights
from slimish.megatron_bridge.full_export import export_full_hf_tensors, export_stage_hf_tensors, in_source_replica
from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
from slimish.network import free_port, node_ip
from slimish.sample import Sample
from slimish.trainer import losses
from slimish.trainer.balance import balanced_partition, imbalance
from slimish.trainer.batch import MicroBatch, collate, collate_packed, split
from slimish.trainer.estimators import ESTIMATORS, StepInputs
from slimish.trainer.lr_schedule import current_lr, rl_optimizer_steps
from slimish.trainer.packing import pack_ranks
from slimish.trainer.parallel import ParallelLayout, init_parallel, resolve_backend
from slimish.trainer.roles import Policy, Reference
from slimish.trainer.rollout_batch import RolloutBatch
from slimish.trainer.schedule import check_weights_finite, step_applied


class TrainerWorker:
    def __init__(self, cfg: JobConfig, *, rank: int, world_size: int):
        self.cfg = cfg
        par = cfg.parallel
        self.layout = ParallelLayout(rank=rank, world_size=world_size, tensor_parallel=par.tensor_parallel,
                                     pipeline_parallel=par.pipeline_parallel, expert_parallel=par.expert_parallel)
        self.arch = architecture_from_hf(read_hf_config(cfg.model.hf_path))
        # RL logprobs are of the distribution the engines sampled from: softmax(logits / temperature).
        self.temperature = cfg.rollout.temperature
        self.rollout: RolloutBatch | None = None  # the step between compute_logprobs and train
        self._sender = None        # rank 0 (or a replica's source): the engine protocol (weight_sync.sync.WeightSync)
        self._stage_sender = None  # a later pipeline stage's leader, with stage senders
        self._stalled_s = 0.0  # failed sends since the last whole one: how long each had made no progress
        self._hung: list[str] = []  # the last failed send: engines that had not answered by a bucket's deadline
        self._stage_links: list = []
        self._groups_made = 0
        self._api_key: str | None = None  # the job's key, for the engines' control endpoints (connect_engines)
        self._offloaded: list = []  # what offload() took, until onload()
        self._offloaded_parts: set[str] = set()

    # ----------------------------------------------------------------------------------------------- setup
    def address(self) -> tuple[str, int]:
        """(this node's IP, a free port there): where rank 0 hosts rendezvous stores."""
        return node_ip(), free_port()

    def setup(self, *, master_addr: str, master_port: int) -> dict:
        """Join the trainer process group, build the model from the HF checkpoint, build the optimizer."""
        torch.set_num_threads(self.cfg.trainer.torch_threads)
        init_parallel(self.layout, master_addr=master_addr, master_port=master_port,
                      backend=self.cfg.parallel.backend, seed=self.cfg.run.seed)
        from megatron.core import parallel_state

        from slimish.trainer.model import build_gpt_model

        dtype = getattr(torch, self.cfg.model.dtype)

        def build():
            model = build_gpt_model(self.arch, tensor_parallel=self.layout.tensor_parallel,
                                    pipeline_parallel=self.layout.pipeline_parallel,
                                    expert_parallel=self.layout.expert_parallel, dtype=dtype,
                                    recompute=self.cfg.trainer.recompute)
            # Micro-batches are padded to their own longest sample: stages exchange each activation's shape first.
            model.config.variable_seq_lengths = self.layout.pipeline_parallel > 1
            return model

        def load_weights(module):
            load_hf_weights(module, self.cfg.model.hf_path, self.arch)

        chunk, steps = self.cfg.trainer.logprob_chunk_tokens, rl_optimizer_steps(self.cfg)
        self.policy = Policy(build, load_weights, self.cfg.trainer.optimizer, total_steps=steps, chunk_tokens=chunk)
        self.estimator = ESTIMATORS[self.cfg.trainer.loss.advantage_estimator]
        self.reference = None
        if self.cfg.trainer.loss.kl_coef > 0 or self.estimator.needs_ref(self.cfg.trainer):
            self.reference = Reference(build, load_weights, chunk_tokens=chunk)
        self.critic = None
        if self.estimator.needs_values:
            from slimish.trainer.critic import Critic

            self.critic = Critic(self.cfg, build, load_weights, total_steps=steps)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_last_rank = parallel_state.get_pipeline_model_parallel_last_rank()
        self.pad_id = 0
        return {"num_params": sum(p.numel() for p in self.policy.module.parameters()),
                # where this rank's GPUs are, and the rank that sends its colocated engine the weights: that
                # engine must see the sender's GPU (see engines.server.visible_devices)
                "gpus": {"node": node_ip(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")},
                "weight_sender": self.replica_ranks()[0] if self._replica_senders() else 0}

    def gpu_telemetry(self) -> dict[str, float]:
        """This rank's GPU memory and utilisation now (`slimish.telemetry`; {} without GPUs)."""
        if not hasattr(self, "_telemetry"):
            from slimish.telemetry import GpuTelemetry

            self._telemetry = GpuTelemetry(f"trainer{self.layout.rank}")
        return self._telemetry.sample()

    def set_learning_rate(self, lr: float) -> None:
        """A constant lr for the SFT warm-up's steps; the RL steps after it follow the LR schedule again."""
        self.policy.set_learning_rate(lr)

    # ------------------------------------------------------------------------------------------ internals
    def _plan(self, samples: list[Sample], num_minibatches: int) -> tuple[list[list[list[Sample]]], list[int], float]:
        """This rank's part of the step: minibatches -> micro-batches (the same split for logprobs and training:
        bitwise ppo_kl), the step indices of its samples in that order, and the step's dp_token_imbalance. Minibatch
        i is samples[i * M:(i + 1) * M] of the whole step, split over the data-parallel ranks balancing tokens
        (`slimish.trainer.balance`), then into micro-batches: packed under trainer.max_tokens_per_micro_batch
        (`slimish.trainer.packing`, the same count on every rank), else micro_batch_size samples each."""
        size = len(samples) // num_minibatches
        budget = self.cfg.trainer.max_tokens_per_micro_batch
        plan, indices, loads = [], [], [0] * self.dp_size
        for first in range(0, size * num_minibatches, size):
            lengths = [len(s.tokens) for s in samples[first:first + size]]
            parts = balanced_partition(lengths, self.dp_size)
            for rank, part in enumerate(parts):
                loads[rank] += sum(lengths[i] for i in part)
            mine = [first + i for i in parts[self.dp_rank]]
            if budget:
                bins = pack_ranks([[lengths[i] for i in part] for part in parts], budget)[self.dp_rank]
                chunks = [[mine[i] for i in b] for b in bins]
            else:
                chunks = split(mine, self.cfg.trainer.micro_batch_size)
            indices += [i for chunk in chunks for i in chunk]
            plan.append([[samples[i] for i in chunk] for chunk in chunks])
        return plan, indices, imbalance(loads)

    def _collate(self, chunk: list[Sample], **kwargs) -> MicroBatch:
        """A micro-batch in host memory, pinned when it is to be copied to a GPU."""
        if self.cfg.trainer.max_tokens_per_micro_batch:
            mb = collate_packed(chunk, pad_id=self.pad_id, **kwargs)
        else:
            mb = collate(chunk, pad_id=self.pad_id, **kwargs)
        return mb.pin_memory() if torch.cuda.is_available() else mb

    @property
    def rollout_indices(self) -> list[int]:
        """The step indices of this rank's samples, in the order of its plan (after `compute_logprobs`)."""
        return list(self.rollout.indices) if self.rollout is not None else []

    def _global_sum(self, value: float) -> float:
        return float(self._dp_sum(torch.tensor([value], dtype=torch.float64, device="cpu")).item())

    def _from_last_stage(self, metrics: dict) -> dict:
        """The last pipeline stage's `metrics` on every stage (only it sees logprobs and losses)."""
        if self.layout.pipeline_parallel == 1:
            return metrics
        import torch.distributed as dist

        box = [metrics]
        dist.broadcast_object_list(box, src=self.pp_last_rank, group=self.pp_group)
        return box[0]

    # ---------------------------------------------------------------------------------------------- RL API
    def compute_logprobs(self, samples: list[Sample], *, policy_version: int | None = None) -> dict:
        """Old (and reference) logprobs of this rank's shard, kept for `train`; returns parity metrics (see
        `_parity_sums`), over every data-parallel rank's shard."""
        plan, indices, dp_token_imbalance = self._plan(samples, self.cfg.trainer.num_minibatches)
        rollout = RolloutBatch(samples=samples, indices=indices, chunks=plan, microbatches=[])
        entropy_sum = entropy_tokens = 0.0
        for minibatch in plan:
            mbs = [self._collate(chunk, per_token={"rollout_logprobs": [s.rollout_logprobs for s in chunk]})
                   for chunk in minibatch]
            rollout.microbatches.append(mbs)
            logprobs, entropy_sums = self.policy.logprobs(mbs, temperature=self.temperature, entropy=True)
            for mb, lp in zip(mbs, logprobs):
                mb.old_logprobs = lp
                entropy_tokens += float(mb.loss_mask.sum())
            entropy_sum += sum(entropy_sums)
            if self.reference is not None:
                for mb, lp in zip(mbs, self.reference.logprobs(mbs, temperature=self.temperature)):
                    mb.ref_logprobs = lp
            if self.critic is not None:
                for mb, values in zip(mbs, self.critic.values(mbs)):
                    mb.old_values = values
        self.rollout = rollout
        metrics = self._dp_reduced_parity(_parity_sums(rollout, policy_version))
        # Mean entropy of the policy over the tokens it trains on (last stage only, like the logprobs).
        metrics["entropy"] = self._global_sum(entropy_sum) / max(self._global_sum(entropy_tokens), 1.0)
        return {**self._from_last_stage(metrics), "dp_token_imbalance": dp_token_imbalance}

    def _dp_reduced_parity(self, sums: torch.Tensor) -> dict:
        """Parity metrics over the whole rollout: every data-parallel rank's shard (max of maxima, summed sums)."""
        if self.dp_size > 1:
            sums = torch.cat([all_reduce(sums[:, :1], group=self.dp_group, op="max"),
                              all_reduce(sums[:, 1:], group=self.dp_group)], dim=1)
        (current_max, current_sum, current_n), (_, stale_sum, stale_n) = sums.tolist()
        return {"logprob_abs_diff_max": current_max, "logprob_abs_diff_mean": current_sum / max(current_n, 1),
                "logprob_abs_diff_stale_mean": stale_sum / max(stale_n, 1)}

    def _dp_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_reduce(tensor, group=self.dp_group)

    def compute_advantages(self, advantages: list[float] | None = None) -> list[float]:
        """Per-token advantages of this rank's samples, kept for `train`: by trainer.loss.advantage_estimator from the
        samples' rewards (`slimish.trainer.estimators`), or, given `advantages` (one per step sample), those spread
        over each response. Returns each step sample's mean advantage over its trained tokens (0 when none), the
        same on every rank (for run.save_rollouts)."""
        if self.rollout is None:
            raise RuntimeError("compute_advantages() needs compute_logprobs() on the same rollout first")
        rollout = self.rollout
        samples = rollout.samples
        masks = rollout.local_responses("loss_mask")  # none off the last stage
        indices = rollout.indices[:len(masks)]
        inputs = StepInputs(rewards=torch.tensor([s.reward if s.scored else 0.0 for s in samples], device="cpu"),
                            scored=torch.tensor([s.scored for s in samples], device="cpu"),
                            group_size=self.cfg.rollout.samples_per_prompt, indices=indices, masks=masks,
                            old=rollout.local_responses("old_logprobs"), ref=rollout.local_responses("ref_logprobs"),
                            values=rollout.local_responses("old_values"), dp_sum=self._dp_sum)
        if advantages is not None:
            per_token = [torch.full_like(m, float(advantages[i])) for i, m in zip(indices, masks)]
        else:
            per_token = self.estimator.advantages(inputs, self.cfg.trainer)
        if self.estimator.returns is not None:
            rollout.returns = self.estimator.returns(inputs, self.cfg.trainer)
        rollout.advantages = per_token
        means = torch.zeros(len(samples), dtype=torch.float64, device="cpu")
        for i, values, mask in zip(indices, per_token, masks):
            means[i] = float((values * mask).sum() / mask.sum().clamp(min=1))
        return self._from_last_stage({"means": self._dp_sum(means).tolist()})["means"]

    def _denominator(self, mbs: list[MicroBatch], aggregation: str, minibatch_samples: int) -> float:
        """The minibatch's loss normaliser, over every data-parallel rank."""
        if aggregation == "seq_mean":  # samples that train
            return self._global_sum(sum(float(mb.trained_samples()) for mb in mbs))
        if aggregation == "constant":  # Dr. GRPO: samples x generation budget, whatever the lengths
            return float(minibatch_samples * self.cfg.rollout.max_new_tokens)
        return self._global_sum(sum(float(mb.loss_mask.sum()) for mb in mbs))

    def train(self, advantages: list[float] | None = None) -> dict:
        """One optimizer step per minibatch on the rollout given to `compute_logprobs`, with the advantages of
        `compute_advantages` (called here, with `advantages`, when it was not)."""
        if self.rollout is None:
            raise RuntimeError("train() needs compute_logprobs() on the same rollout first")
        if self.rollout.advantages is None or advantages is not None:
            self.compute_advantages(advantages)
        rollout = self.rollout
        loss_cfg = self.cfg.trainer.loss
        aggregation = self.estimator.aggregation or loss_cfg.token_aggregation
        per_token = iter(rollout.advantages)
        returns = iter(rollout.returns or [])
        sums: dict[str, list[float]] = {}
        grad_norms, critic_norms = [], []
        for mbs in rollout.microbatches:
            denom = self._denominator(mbs, aggregation, rollout.minibatch_samples)
            scale = len(mbs) * self.dp_size  # Megatron divides by num_microbatches, DDP averages over DP
            for mb in mbs:
                if rollout.on_last_stage:
                    mb.advantages = mb.scatter([next(per_token) for _ in mb.spans])
                    if self.critic is not None:
                        mb.returns = mb.scatter([next(returns) for _ in mb.spans])
                # seq_mean as a token mean with each sample's tokens weighted 1 / its length: the same for a packed
                # row holding several samples as for one sample per row.
                mb.weights = mb.sequence_weights() if aggregation == "seq_mean" else mb.loss_mask
                mb.segments = mb.sample_segments()

            def loss_fn(mb, logprobs, denom=denom, scale=scale):
                out = losses.policy_loss(
                    logprobs=logprobs, old_logprobs=mb.old_logprobs, advantages=mb.advantages, mask=mb.weights,
                    clip_eps_low=loss_cfg.clip_eps_low, clip_eps_high=loss_cfg.clip_eps_high,
                    aggregation="token_mean", denom=denom, ref_logprobs=mb.ref_logprobs, kl_coef=loss_cfg.kl_coef,
                    kl_estimator=loss_cfg.kl_estimator, rollout_logprobs=mb.rollout_logprobs,
                    tis_cap=loss_cfg.tis_cap, mis_band=(loss_cfg.mis_low, loss_cfg.mis_high),
                    is_level=loss_cfg.is_level, ratio_level=self.estimator.ratio_level, segments=mb.segments)
                return out.loss * scale, out.metrics

            outputs, grad_norm = self.policy.step(mbs, loss_fn, temperature=self.temperature)
            if self.critic is not None:
                critic_outputs, critic_norm = self._critic_step(mbs, scale)
                outputs = [{**o, **c} for o, c in zip(outputs, critic_outputs)]
                critic_norms.append(critic_norm)
            # Each metric is aggregated like the loss, so micro-batches and data-parallel ranks add up.
            for key in (outputs[0] if outputs else {}):
                sums.setdefault(key, []).append(self._global_sum(sum(float(o[key]) for o in outputs)))
            grad_norms.append(grad_norm)
        self.rollout = None
        metrics = {key: sum(values) / len(values) for key, values in sums.items()}
        # Optimizer steps not applied (their gradients were not finite: `schedule.optimizer_step`), policy's and
        # critic's: every rank agrees.
        metrics["skipped_steps"] = sum(not step_applied(norm) for norm in grad_norms + critic_norms)
        if critic_norms:
            metrics["critic_grad_norm"] = critic_norms[-1]
        if sums:  # first minibatch: exactly 0 when on-policy; the last shows how far the minibatches went
            metrics["ppo_kl"], metrics["ppo_kl_last"] = sums["ppo_kl"][0], sums["ppo_kl"][-1]
        # lr: the last minibatch's (every rank holds it; not a last-stage value)
        return {**self._from_last_stage({**metrics, "grad_norm": grad_norms[-1]}),
                "lr": current_lr(self.policy.optimizer)}

    def _critic_step(self, mbs: list[MicroBatch], scale: float):
        """One critic optimizer step on a minibatch: regression to the estimator's returns, clipped around the
        values of `compute_logprobs`, normalised like the policy loss (token_mean over the same tokens)."""
        token_denom = self._denominator(mbs, "token_mean", len(mbs))
        return self.critic.train(mbs, denom=token_denom, scale=scale)

    # --------------------------------------------------------------------------------------------- SFT API
    def sft_step(self, samples: list[Sample]) -> dict:
        """One supervised step: mean token NLL over the loss-masked (response) tokens."""
        (chunks,), _, _ = self._plan(samples, num_minibatches=1)
        mbs = [self._collate(chunk) for chunk in chunks]
        denom = self._denominator(mbs, "token_mean", len(samples))
        scale = len(mbs) * self.dp_size

        def loss_fn(mb, logprobs):
            nll = -(logprobs * mb.loss_mask).sum() / denom
            return nll * scale, {"nll": nll.detach()}

        outputs, grad_norm = self.policy.step(mbs, loss_fn, scheduled=False)
        return self._from_last_stage({"sft_loss": self._global_sum(sum(float(o["nll"]) for o in outputs)),
                                      "grad_norm": grad_norm})

    # ------------------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Write the policy model and optimizer state to the directory `path` (Megatron dist checkpoint; every rank
        calls it), and the critic's, if any, beside it (`checkpoint.critic_path`). The reference model is not saved:
        it is the initial policy, rebuilt from model.hf_path. An offloaded trainer is onloaded for the save and
        offloaded again after it (colocated, the engines release their KV cache around it)."""
        from slimish.trainer import checkpoint

        parts = tuple(self._offloaded_parts)
        if parts:  # saved from the device (Megatron's dist checkpoint), and offloaded again after
            self.onload()
        check_weights_finite(self.policy.module, doing=f"saving the checkpoint {Path(path).parent.name}")
        self.policy.save(path)
        if self.critic is not None:
            self.critic.save(checkpoint.critic_path(path))
        if parts:
            self.offload(parts)

    def load_checkpoint(self, path: str) -> None:
        """Load a checkpoint written by `save_checkpoint` at any layout into this (set-up) worker. The learning-rate
        schedule continues from the checkpoint's step with the config's shape (`slimish.trainer.lr_schedule`)."""
        from slimish.trainer import checkpoint

        self.policy.load(path)
        if self.critic is not None:
            self.critic.load(checkpoint.critic_path(path))
        self.rollout = None

    # ------------------------------------------------------------------------------------------ weight sync
    def connect_engines(self, *, engine_urls: list[str], engine_tp: int, master_addr: str,
                        api_key: str | None = None, engines_by_rank: list[str | None] | None = None) -> dict:
        """Rank 0 joins a process group with every engine in `engine_urls` (at `master_addr`; it calls them with
        `api_key`); with stage senders (`weight_sync.stage_senders`) so does every later pipeline stage's leader,
        each with a group of its own. Colocated with the tensor transport (`_replica_senders`), the source rank of
        every data-parallel replica instead connects to the engines on its replica's GPUs: `engines_by_rank[r]` is
        the engine on trainer rank r's GPU (None: not synced now).
        Other ranks only take part in the export's gathers. Every rank calls it. Called again when the engines
        change (one died, a restarted one joins): the old groups are torn down and new ones, under new names and
        on free ports, replace them."""
        self._groups_made += 1
        self._api_key = api_key
        for sender in (self._sender, self._stage_sender):
            if sender is not None:
                sender.close()
        self._sender = self._stage_sender = None
        if self._replica_senders() and engines_by_rank is not None:
            replica = self.replica_ranks()
            own = [engines_by_rank[r] for r in replica if r < len(engines_by_rank) and engines_by_rank[r]]
            if self.layout.rank != replica[0] or not own:
                return {}
            return self._connect_rank0(own, engine_tp, node_ip(), stages=[])
        if not self._stage_senders():
            return self._connect_rank0(engine_urls, engine_tp, master_addr, stages=[]) if self.layout.rank == 0 else {}
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from slimish.megatron_bridge.full_export import is_stage_leader, stage_leader_rank
        from slimish.weight_sync.stages import StageLink, StageSender

        stage, pp_group = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_group()
        leader = in_source_replica() and is_stage_leader()
        metrics: dict = {}
        for turn in range(self.layout.pipeline_parallel):
            # One stage's group at a time: an engine joins groups in the order their requests reach it, and a
            # group's rendezvous needs every engine.
            if leader and stage == turn == 0:
                links = [StageLink(stage=s, rank=stage_leader_rank(s), group=pp_group, group_name=self._group_name(s))
                         for s in range(1, self.layout.pipeline_parallel)]
                metrics = self._connect_rank0(engine_urls, engine_tp, master_addr, stages=links)
            elif leader and stage == turn:
                context = self._transport_context(engine_tp, node_ip(), free_port(), self._group_name(stage))
                self._stage_sender = StageSender(
                    stage=stage, context=context, engine_urls=engine_urls,
                    bucket_bytes=int(self.cfg.weight_sync.bucket_mb * 2**20), coordinator=stage_leader_rank(0),
                    group=pp_group, expected_checksums=self._expected_checksums(engine_urls, engine_tp))
                self._stage_sender.connect()
            dist.barrier()
        return metrics

    def _replica_senders(self) -> bool:
        """Colocated with the tensor transport (and no expert parallelism, whose export spans replicas): every
        data-parallel replica exports the model, and its source rank sends it to the engines on the replica's
        GPUs, from its own GPU by CUDA IPC; else rank 0 sends to every engine."""
        cfg = self.cfg
        return (cfg.placement.colocate and cfg.weight_sync.transport == "tensor"
                and self.layout.expert_parallel == 1)

    def replica_ranks(self) -> list[int]:
        """The global ranks of this rank's data-parallel replica (its model-parallel group: tensor x pipeline),
        in order; the first holds tensor- and pipeline-parallel rank 0, where the replica's export ends."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return [self.layout.rank]
        return sorted(dist.get_process_group_ranks(ps.get_model_parallel_group()))

    def _stage_senders(self) -> bool:
        ws = self.cfg.weight_sync
        return ws.transport == "broadcast" and ws.stage_senders and self.layout.pipeline_parallel > 1

    def _group_name(self, stage: int = 0) -> str:
        suffix = f"_stage{stage}" if stage else ""
        return f"slimish_weight_sync_{self._groups_made}{suffix}"

    def _transport_context(self, engine_tp: int, master_addr: str, master_port: int, group_name: str):
        from slimish.weight_sync.transport import TransportContext

        ws = self.cfg.weight_sync
        return TransportContext(master_addr=master_addr, master_port=master_port,
                                backend=resolve_backend(self.cfg.parallel.backend), group_name=group_name,
                                engine_tp=engine_tp, disk_dir=self.weight_sync_dir(), api_key=self._api_key,
                                bucket_timeout_s=ws.bucket_timeout_s, min_bandwidth_mib_s=ws.min_bandwidth_mib_s)

    def _expected_checksums(self, engine_urls: list[str], engine_tp: int):
        """What makes the expected engine checksums of the tensors a sender sends (None: not verifying, or layout not
        predicted), for engines sharded as the first of `engine_urls` says it is (its /server_info); raises if that
        engine's tensor-parallel size is not `engine_tp` (the weight-sync group's ranks follow it)."""
        from slimish.weight_sync.checksums import ExpectedChecksums, layout_supported, sharding_of

        sharding = sharding_of(engine_urls[0], api_key=self._api_key)
        if sharding.tp != engine_tp:
            raise ValueError(f"rollout.engine.tensor_parallel: got {engine_tp}, but engine {engine_urls[0]} runs "
                             f"--tp-size {sharding.tp}; set rollout.engine.tensor_parallel={sharding.tp}")
        if not (self.cfg.weight_sync.verify and layout_supported(self.arch, sharding)):
            return None
        return functools.partial(ExpectedChecksums, self.arch, getattr(torch, self.cfg.model.dtype), sharding)

    def _connect_rank0(self, engine_urls: list[str], engine_tp: int, master_addr: str, stages: list) -> dict:
        from slimish.hooks import load_function
        from slimish.weight_sync.sync import WeightSync

        ws = self.cfg.weight_sync
        port = ws.master_port if self._groups_made == 1 and ws.master_port else free_port()
        context = self._transport_context(engine_tp, master_addr, port, self._group_name())
        self._stage_links = stages
        self._sender = WeightSync(transport=ws.transport, context=context, engine_urls=engine_urls,
                                  bucket_bytes=int(ws.bucket_mb * 2**20), verify=ws.verify,
                                  expected_checksums=self._expected_checksums(engine_urls, engine_tp),
                                  after_bucket=load_function(ws.after_bucket_hook) if ws.after_bucket_hook else None,
                                  in_flight=load_function(ws.in_flight_hook) if ws.in_flight_hook else None)
        t0 = time.monotonic()
        self._sender.connect()
        return {"time_connect_s": time.monotonic() - t0}

    def weight_sync_dir(self) -> str:
        """Where the disk transport writes this run's shards (`slimish.run_layout.weight_sync_root`)."""
        from slimish.run_layout import weight_sync_root

        run = self.cfg.run
        return str(weight_sync_root(self.cfg.weight_sync.disk_dir, Path(run.output_dir) / run.name))

    def sync_weights(self, version: int) -> dict:
        """Send the current weights to every engine as weight version `version`. Rank 0 sends the whole model
        (`export_full_hf_tensors`: the later stages' layers reach it over the pipeline group), or with stage senders
        its own stage while every later stage's leader sends its own (`export_stage_hf_tensors`); the TP / EP
        gathers involve every rank of the replica. Other data-parallel replicas hold the same weights and sit out,
        unless every replica sends to its own engines (`_replica_senders`)."""
        check_weights_finite(self.policy.module, doing=f"sending weight version {version} to the engines")
        if not (in_source_replica() or self._replica_senders()):
            return {}
        if not self._stage_senders():
            tensors = export_full_hf_tensors(self.policy.module, self.arch)
        else:
            tensors = export_stage_hf_tensors(self.policy.module, self.arch)
        try:
            if self._sender is not None:
                try:
                    metrics = self._sender.send(tensors, version=str(version), stages=self._stage_links)
                except Exception:
                    self._stalled_s += self._sender.stalled_s
                    self._hung = list(self._sender.hung)
                    raise
                stalled, self._stalled_s = self._stalled_s, 0.0
                return {**metrics, "sync_engines": len(self._sender.clients), "time_sync_stalled_s": stalled}
            if self._stage_sender is not None:
                self._stage_sender.send(tensors)
            return {}
        finally:
            # Ranks that send nothing only feed the export's gathers; after a failed send the senders finish them
            # too, so no rank is left inside a collective. (After a whole send there is nothing left.)
            for _ in tensors:
                pass

    def hung_engines(self) -> list[str]:
        """After a failed `sync_weights`: the engines that had not answered by a bucket's deadline (rank 0's
        sender; [] on other ranks and when the sync failed otherwise)."""
        return self._hung

    def release_sync(self, reason: str) -> None:
        """Give up the weight sync this rank is sending, wherever it waits (`WeightSync.release`): the driver calls
        it, concurrently with `sync_weights` (the actor's control concurrency group, see
        `slimish.orchestration.ray_cluster`), when an engine of the sync died or froze. A no-op between syncs."""
        for sender in (self._sender, self._stage_sender):
            if sender is not None:
                sender.release(reason)

    # ---------------------------------------------------------------------------------------- offload
    def _role_memory(self) -> list[tuple[list, object]]:
        """(modules, optimizer) of each role this rank holds: the policy, the critic, the reference model."""
        roles = [([self.policy.module], self.policy.optimizer)]
        if self.critic is not None:
            roles.append(([self.critic.module], self.critic.optimizer))
        if self.reference is not None:
            roles.append(([self.reference.module], None))
        return roles

    def offload(self, parts: tuple[str, ...] | list[str] = ("params", "state")) -> dict:
        """Move `parts` ("params": the models; "state": optimizer state and gradients) of every role's device memory
        to host memory (`slimish.trainer.offload`; nothing on the CPU), until `onload()`: what a colocated trainer
        does while the engines generate on its GPUs. Returns the bytes copied and freed, and the seconds taken."""
        from slimish.trainer import offload

        parts = tuple(parts)
        assert not self._offloaded_parts & set(parts), f"offload({parts}) twice without onload()"
        start = time.perf_counter()
        roles = [offload.offload(modules, optimizer, parts) for modules, optimizer in self._role_memory()]
        self._offloaded += roles
        self._offloaded_parts |= set(parts)
        return {"offload_bytes": sum(role.bytes_copied for role in roles),
                "offload_freed_bytes": sum(role.bytes_freed for role in roles),
                "time_offload_s": time.perf_counter() - start}

    @property
    def offloaded(self) -> bool:
        return bool(self._offloaded_parts)

    def onload(self) -> dict:
        """Give back what `offload()` moved: parameters and optimizer state bit-exact, gradients zeroed."""
        from slimish.trainer import offload

        assert self.offloaded, "onload() without offload()"
        start = time.perf_counter()
        for role in self._offloaded:
            offload.onload(role)
        self._offloaded, self._offloaded_parts = [], set()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"time_onload_s": time.perf_counter() - start}

    def device_bytes(self) -> int:
        """What the roles hold on this rank's device now (0 while offloaded; 0 on the CPU)."""
        from slimish.trainer import offload

        return sum(offload.device_bytes(modules, optimizer) for modules, optimizer in self._role_memory())

    def export_state(self) -> dict[str, torch.Tensor]:
        """HF-named copy of the whole model on rank 0 (empty elsewhere); every rank must call it. For tests."""
        if not in_source_replica():
            return {}
        return {name: t.clone() for name, t in export_full_hf_tensors(self.policy.module, self.arch)}

    def shutdown(self) -> None:
        from slimish.trainer.parallel import shutdown_parallel

        for sender in (self._sender, self._stage_sender):
            if sender is not None:
                sender.close()
        shutdown_parallel()


def _parity_sums(rollout: RolloutBatch, policy_version: int | None) -> torch.Tensor:
    """|engine - trainer| logprobs of this rank's loss-masked response tokens, as [[max, sum, count]] for the tokens
    the engines sampled with `policy_version`, the weights the trainer holds now (all tokens when None), and the
    same for the tokens of older versions (partial rollouts), which differ by the policy's change since. Reported
    as logprob_abs_diff_max / _mean and logprob_abs_diff_stale_mean."""
    sums = {"current": [0.0, 0.0, 0], "stale": [0.0, 0.0, 0]}  # max, sum, count
    for minibatch, mbs in zip(rollout.chunks, rollout.microbatches):
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
