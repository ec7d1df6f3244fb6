"""One Megatron trainer process (a Ray actor of `TrainerGroup`): its roles, one RL step per call, the weight sync's
sending end, checkpoints, offload.

The driver calls, per RL step: `rl_step(samples, policy_version)` (`slimish.trainer.rl_step`: logprobs, advantages,
one optimizer step per minibatch; nothing is kept after the call) -> `sync_weights(version)` (`WeightSender`).
Every rank of a trainer group receives the same calls; each keeps the data-parallel shard of the samples that
belongs to it. With pipeline parallelism the per-token logprobs and the loss exist on the last stage only; every
stage returns the last stage's metrics.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from slimish.config.schema import JobConfig
from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
from slimish.megatron_bridge.initial_weights import InitialWeights
from slimish.network import free_port, node_ip
from slimish.sample import Sample
from slimish.trainer import rl_step
from slimish.trainer.estimators import ESTIMATORS
from slimish.trainer.lr_schedule import rl_optimizer_steps
from slimish.trainer.parallel import ParallelLayout, init_parallel
from slimish.trainer.roles import Policy, Reference
from slimish.trainer.schedule import check_weights_finite
from slimish.weight_sync.sender import WeightSender

logger = logging.getLogger(__name__)


class TrainerWorker:
    def __init__(self, cfg: JobConfig, *, rank: int, world_size: int):
        self.cfg = cfg
        par = cfg.parallel
        self.layout = ParallelLayout(rank=rank, world_size=world_size, tensor_parallel=par.tensor_parallel,
                                     pipeline_parallel=par.pipeline_parallel, expert_parallel=par.expert_parallel,
                                     context_parallel=par.context_parallel, virtual_pipeline=par.virtual_pipeline,
                                     expert_tensor_parallel=par.expert_tensor_parallel)
        self.arch = architecture_from_hf(read_hf_config(cfg.model.hf_path))
        self.step: rl_step.StepContext | None = None  # what every step runs with (setup)
        self.sender = WeightSender(cfg, self.arch, rank=rank, pipeline_parallel=par.pipeline_parallel,
                                   expert_parallel=par.expert_parallel)
        self._offloaded: list = []  # what offload() took, until onload()
        self._offloaded_parts: set[str] = set()
        self._writes = None  # background checkpoint writes (checkpoint.async_save), from the first such save
        self.weights_read: dict = {}  # what reading the initial weights cost this rank (`InitialWeights.report`)

    # ----------------------------------------------------------------------------------------------- setup
    def address(self) -> tuple[str, int]:
        """(this node's IP, a free port there): where rank 0 hosts rendezvous stores."""
        return node_ip(), free_port()

    def setup(self, *, master_addr: str, master_port: int) -> dict:
        """Join the trainer process group, build the roles from model.hf_path or model.megatron_path
        (`InitialWeights`: the policy and its optimizer; the reference model and the critic when the loss or
        estimator needs them, which copy the policy's weights rather than read them again)."""
        torch.set_num_threads(self.cfg.trainer.torch_threads)
        init_parallel(self.layout, master_addr=master_addr, master_port=master_port,
                      backend=self.cfg.parallel.backend, seed=self.cfg.run.seed)
        from megatron.core import parallel_state as ps

        from slimish.trainer.attention import check_trainable
        from slimish.trainer.model import build_gpt_model

        dtype = getattr(torch, self.cfg.model.dtype)
        check_trainable(self.cfg.trainer.attention, multi_latent=self.arch.mla is not None,
                        tensor_parallel=self.layout.tensor_parallel)

        def build_chunk(vp_stage):
            model = build_gpt_model(self.arch, tensor_parallel=self.layout.tensor_parallel,
                                    pipeline_parallel=self.layout.pipeline_parallel,
                                    expert_parallel=self.layout.expert_parallel,
                                    expert_tensor_parallel=self.layout.expert_tensor, dtype=dtype,
                                    recompute=self.cfg.trainer.recompute,
                                    recompute_modules=tuple(self.cfg.trainer.recompute_modules),
                                    attention=self.cfg.trainer.attention,
                                    sequence_parallel=self.cfg.parallel.sequence_parallel,
                                    context_parallel=self.layout.context_parallel,
                                    cp_comm_type=self.cfg.parallel.cp_comm_type,
                                    first_stage_layers=self.cfg.parallel.first_stage_layers,
                                    last_stage_layers=self.cfg.parallel.last_stage_layers,
                                    virtual_pipeline=self.layout.virtual_pipeline, vp_stage=vp_stage)
            # Micro-batches are padded to their own longest sample: stages exchange each activation's shape first.
            # The interleaved schedule hangs exchanging shapes (measured: PP3 x VPP2 on gloo): there the micro-batches
            # of a schedule share one shape (`rl_step.collate_minibatch`) and none is exchanged.
            model.config.variable_seq_lengths = self.layout.pipeline_parallel > 1 and self.layout.virtual_pipeline == 1
            return model

        def build():  # this rank's model chunks: parallel.virtual_pipeline of them (interleaved 1F1B), or one
            vpp = self.layout.virtual_pipeline
            return [build_chunk(i if vpp > 1 else None) for i in range(vpp)]

        # model.hf_path or model.megatron_path, read once per rank (the later roles copy the policy's weights)
        weights = InitialWeights(self.arch, hf_path=self.cfg.model.hf_path,
                                 megatron_path=self.cfg.model.megatron_path)
        load_weights = weights.load

        chunk, steps = self.cfg.trainer.logprob_chunk_tokens, rl_optimizer_steps(self.cfg)
        policy = Policy(build, load_weights, self.cfg.trainer.optimizer, total_steps=steps, chunk_tokens=chunk)
        estimator = ESTIMATORS[self.cfg.trainer.loss.advantage_estimator]
        reference = critic = None
        if self.cfg.trainer.loss.kl_coef > 0 or estimator.needs_ref(self.cfg.trainer):
            reference = Reference(build, load_weights, chunk_tokens=chunk)
        if estimator.needs_values:
            from slimish.trainer.critic import Critic

            critic = Critic(self.cfg, build, load_weights, total_steps=steps)
        self.step = rl_step.StepContext(
            cfg=self.cfg, policy=policy, reference=reference, critic=critic, estimator=estimator,
            dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
            dp_group=ps.get_data_parallel_group(), pp_size=self.layout.pipeline_parallel,
            pp_group=ps.get_pipeline_model_parallel_group(), pp_last_rank=ps.get_pipeline_model_parallel_last_rank())
        self.weights_read = weights.report()
        logger.info("trainer rank %d: %s", self.layout.rank, weights.summary())
        return {"weights_read": self.weights_read,
                "num_params": sum(p.numel() for chunk in policy.chunks for p in chunk.parameters()),
                # where this rank's GPUs are, and the rank that sends its colocated engine the weights: that
                # engine must see the sender's GPU (see engines.server.visible_devices)
                "gpus": {"node": node_ip(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")},
                "weight_sender": self.sender.sending_rank()}

    def gpu_telemetry(self) -> dict[str, float]:
        """This rank's GPU memory and utilisation now (`slimish.telemetry`; {} without GPUs)."""
        if not hasattr(self, "_telemetry"):
            from slimish.telemetry import GpuTelemetry

            self._telemetry = GpuTelemetry(f"trainer{self.layout.rank}")
        return self._telemetry.sample()

    def set_learning_rate(self, lr: float) -> None:
        """A constant lr for the SFT warm-up's steps; the RL steps after it follow the LR schedule again."""
        self.step.policy.set_learning_rate(lr)

    # ------------------------------------------------------------------------------------------------ steps
    def rl_step(self, samples: list[Sample], policy_version: int | None = None) -> dict:
        """One RL step on the step's `samples`, which the engines sampled with weight version `policy_version`
        (`slimish.trainer.rl_step`): {"metrics": the step's trainer metrics, with this call's phase times
        time_logprobs_s, time_advantages_s and time_optimizer_s; "advantage_means": each sample's mean advantage,
        for run.save_rollouts}. Nothing of the step stays on the worker."""
        t0 = time.perf_counter()
        batch, metrics = rl_step.prepare(self.step, samples, policy_version=policy_version)
        t1 = time.perf_counter()
        means = rl_step.advantages(self.step, batch)
        t2 = time.perf_counter()
        metrics.update(rl_step.train(self.step, batch))
        metrics.update(time_logprobs_s=t1 - t0, time_advantages_s=t2 - t1, time_optimizer_s=time.perf_counter() - t2)
        return {"metrics": metrics, "advantage_means": means}

    def sft_step(self, samples: list[Sample]) -> dict:
        """One supervised step (`rl_step.sft_step`)."""
        return rl_step.sft_step(self.step, samples)

    # ------------------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str, background: bool = False) -> None:
        """Write the policy model and optimizer state to the directory `path` (Megatron dist checkpoint; every rank
        calls it), and the critic's, if any, beside it (`checkpoint.critic_path`). The reference model is not saved:
        it is the initial policy, rebuilt from model.hf_path (or model.megatron_path). An offloaded trainer is
        onloaded for the save and offloaded again after it (colocated, the engines release their KV cache around
        it). `background` (checkpoint.async_save): return once the state is staged in host memory; the files are
        written while the next step runs, and `path` is complete only after `finish_checkpoint()`."""
        from slimish.trainer import checkpoint

        self.finish_checkpoint()  # one save in flight at a time
        parts = tuple(self._offloaded_parts)
        if parts:  # saved from the device (Megatron's dist checkpoint), and offloaded again after
            self.onload()
        check_weights_finite(self.step.policy.chunks, doing=f"saving the checkpoint {Path(path).parent.name}")
        if background and self._writes is None:
            from slimish.trainer.background_writes import BackgroundWrites

            self._writes = BackgroundWrites()
        writes = self._writes if background else None
        self.step.policy.save(path, writes)
        if self.step.critic is not None:
            self.step.critic.save(checkpoint.critic_path(path), writes)
        if parts:
            self.offload(parts)

    def finish_checkpoint(self) -> int:
        """Wait until the files of a background `save_checkpoint` are written on every rank and finalised (every
        rank calls it; a no-op without one); returns the number of saves finished (policy and critic count one
        each)."""
        return self._writes.finish() if self._writes is not None and self._writes.pending else 0

    def load_checkpoint(self, path: str) -> None:
        """Load a checkpoint written by `save_checkpoint` at any layout into this (set-up) worker. The learning-rate
        schedule continues from the checkpoint's step with the config's shape (`slimish.trainer.lr_schedule`)."""
        from slimish.trainer import checkpoint

        self.finish_checkpoint()
        self.step.policy.load(path)
        if self.step.critic is not None:
            self.step.critic.load(checkpoint.critic_path(path))

    # ------------------------------------------------------------------------------------------ weight sync
    def connect_engines(self, **engines) -> dict:
        """`WeightSender.connect` (every rank calls it; the arguments are its)."""
        return self.sender.connect(**engines)

    def sync_weights(self, version: int) -> dict:
        """Send the current weights to the engines as weight version `version` (`WeightSender.send`), after checking
        that every one of them is finite (bad weights are never sent)."""
        check_weights_finite(self.step.policy.chunks, doing=f"sending weight version {version} to the engines")
        return self.sender.send(self.step.policy.chunks, version)

    def hung_engines(self) -> list[str]:
        """After a failed `sync_weights`: the engines that had not answered by a bucket's deadline (the sending
        rank's; [] on other ranks and when the sync failed otherwise)."""
        return self.sender.hung

    def release_sync(self, reason: str) -> None:
        """Give up the weight sync this rank is sending, wherever it waits (`WeightSender.release`): the driver calls
        it, concurrently with `sync_weights` (the actor's control concurrency group, see
        `slimish.orchestration.ray_cluster`), when an engine of the sync died or froze. A no-op between syncs."""
        self.sender.release(reason)

    # ---------------------------------------------------------------------------------------- offload
    def _role_memory(self) -> list[tuple[list, object]]:
        """(modules, optimizer) of each role this rank holds: the policy, the critic, the reference model."""
        step = self.step
        roles = [(step.policy.chunks, step.policy.optimizer)]
        if step.critic is not None:
            roles.append((step.critic.chunks, step.critic.optimizer))
        if step.reference is not None:
            roles.append((step.reference.chunks, None))
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

    def shutdown(self) -> None:
        from slimish.trainer.parallel import shutdown_parallel

        if self._writes is not None:  # a save never finished is never committed: its writers go
            self._writes.abort()
        self.sender.close()
        shutdown_parallel()
