"""Seconds per RL step of each wall, on paper, and which one binds.

  train    model FLOPs of the step's tokens: 6 x active parameters per token for the optimizer pass (8 with full
           recompute), 2 more for the old logprobs, 2 for the reference when the trainer builds one and, with a
           critic (ppo), 2 for its values and 6 (8) for its own optimizer pass, plus causal attention
           (2 x layers x hidden x length^2 per forward per sample; one forward more with selective recompute of
           core_attn; its other modules are not counted); over every trainer GPU at plan.gpu_tflops x mfu.
  sync     the wire time of `slimish.weight_sync.estimate.sync_seconds` for the model's bytes (sharded where
           weight_sync.sharded would shard: `sharded_engine_tp`), the routed experts' way to their stage's leader
           under expert parallelism included.
  rollout  the step's generated tokens over the engines' decode throughput, and never less than the longest
           response at one request's pace (a step waits for its slowest group).
  reward   samples x seconds per sample over the reward calls that run at once.

A step takes the sum of the walls with rl.mode sync; with one_step_off or async generation overlaps training, so it
takes the longer of train and rollout + reward, plus the sync (with async, a sync every rl.sync_every steps: its
share per step).
"""

from __future__ import annotations

from dataclasses import dataclass

from slimish.config.validate import SHARDED_TRANSPORTS
from slimish.planning.memory import DTYPE_BYTES, builds_roles
from slimish.planning.params import ParamCount
from slimish.weight_sync.estimate import Cluster, sync_seconds

ADVICE = {
    "train": "more trainer GPUs (data parallel), trainer.max_tokens_per_micro_batch (packing), or recompute off if "
             "memory allows",
    "sync": "stage senders (weight_sync.stage_senders with pipeline parallelism), fewer syncs (rl.mode async with "
            "rl.sync_every), or a faster link",
    "rollout": "more engines, or rl.mode one_step_off / async, or rollout.partial.mode abort / retract, so that "
               "generation overlaps training",
    "reward": "more reward workers (a remote reward service), or a cheaper reward",
}
# Colocated, generation cannot overlap training (they take turns on the same GPUs).
COLOCATED_ADVICE = {**ADVICE,
                    "rollout": "more requests per engine (rollout.max_concurrency, rollout.engine.max_total_tokens), "
                               "rollout.partial.mode abort (the slowest groups wait for the next step), or separate "
                               "engine GPUs (placement.colocate=false) so that generation can overlap training",
                    "sync": "a faster transport between colocated ranks, or fewer, larger buckets"}


@dataclass(frozen=True, kw_only=True)
class Walls:
    train: float
    sync: float | None  # None: no estimate for the transport
    rollout: float
    reward: float
    overlapped: bool = False  # rl.mode one_step_off / async: generation overlaps training

    def step_seconds(self) -> float:
        """What a step takes: the walls one after another, or, overlapped, the longer of train and rollout +
        reward, plus the sync."""
        if not self.overlapped:
            return sum(self.seconds().values())
        return max(self.train, self.rollout + self.reward) + (self.sync or 0.0)

    def seconds(self) -> dict[str, float]:
        out = {"train": self.train, "rollout": self.rollout, "reward": self.reward}
        if self.sync is not None:
            out["sync"] = self.sync
        return out

    @property
    def binding(self) -> str:
        seconds = self.seconds()
        return max(seconds, key=seconds.get)


def step_walls(cfg, arch, params: ParamCount) -> Walls:
    plan, ro, tr = cfg.plan, cfg.rollout, cfg.trainer
    samples = ro.prompts_per_step * ro.samples_per_prompt
    response = plan.mean_response_tokens or ro.max_new_tokens / 2
    length = plan.prompt_tokens + response
    optimizer_pass = 8 if tr.recompute == "full" else 6
    reference, critic = builds_roles(cfg)  # the roles the trainer builds, by the same rule as its set-up
    passes = optimizer_pass + 2 + (2 if reference else 0) + (2 + optimizer_pass if critic else 0)
    dense_flops = passes * params.active * samples * length
    if tr.recompute == "selective" and "core_attn" in tr.recompute_modules:
        passes += 2  # the core attention's forward again in the backward pass
    attention_flops = passes / 2 * 2 * arch.num_layers * arch.hidden_size * length ** 2 * samples
    train = (dense_flops + attention_flops) / (cfg.parallel.num_trainer_ranks * plan.gpu_tflops * 1e12 * plan.mfu)
    ws = cfg.weight_sync
    sync = None
    if ws.transport in ("broadcast", "disk"):
        cluster = Cluster(nic_gbit_s=plan.nic_gbit_s, fs_write_gbyte_s=plan.fs_write_gbyte_s,
                          fs_read_gbyte_s=plan.fs_read_gbyte_s)
        dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
        sync = sync_seconds(params.total * dtype_bytes, transport=ws.transport, cluster=cluster,
                            pipeline_parallel=cfg.parallel.pipeline_parallel, stage_senders=ws.stage_senders,
                            engine_shards=sharded_engine_tp(cfg, arch),
                            expert_bytes=sum(params.experts_per_layer) * dtype_bytes,
                            expert_parallel=cfg.parallel.expert_parallel,
                            expert_tensor_parallel=cfg.parallel.expert_tensor_parallel or cfg.parallel.tensor_parallel)
    rollout = max(samples * response / (ro.engine.num_engines * plan.decode_tokens_per_s),
                  ro.max_new_tokens / plan.request_tokens_per_s)
    reward = samples * plan.reward_s_per_sample / plan.reward_workers
    if sync is not None and cfg.rl.mode == "async":
        sync /= cfg.rl.sync_every  # its share per step
    return Walls(train=train, sync=sync, rollout=rollout, reward=reward, overlapped=cfg.rl.mode != "sync")


def sharded_engine_tp(cfg, arch) -> int:
    """The engines' tensor-parallel size where the sync would be sharded (weight_sync.sharded, as the sender decides
    it for the engines slimish starts: a transport that sends shards, engines of more than one rank under 'auto', a
    known layout: not DP attention), else 1. `arch`: the model (every family's layout is known)."""
    ws, engine = cfg.weight_sync, cfg.rollout.engine
    if ws.sharded == "off" or ws.transport not in SHARDED_TRANSPORTS or engine.attention_data_parallel > 1:
        return 1
    return engine.tensor_parallel
