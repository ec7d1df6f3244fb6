"""Seconds per RL step of each wall, on paper, and which one binds.

  train    model FLOPs of the step's tokens: 6 x active parameters per token for the optimizer pass (8 with full
           recompute), 2 more for the old logprobs, 2 for the reference when the trainer builds one and, with a
           critic (ppo), 2 for its values and 6 (8) for its own optimizer pass, plus causal attention
           (2 x layers x hidden x length^2 per forward per sample; one forward more with selective recompute of
           core_attn; its other modules are not counted); over every trainer GPU at plan.gpu_tflops x mfu.
  sync     the wire time of `slimish.weight_sync.estimate.sync_seconds` for the model's bytes, on the route the
           config takes (`sync_estimate`): full (every engine rank receives the model), or sharded (each engine rank
           its shard) from one sender or from several (each pipeline stage's leader, and with expert parallelism
           each expert-parallel rank's owner of its experts), the routed experts' way to the rank that sends them
           included.
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
from slimish.weight_sync.estimate import Cluster, StageBytes, sync_seconds

ADVICE = {
    "train": "more trainer GPUs (data parallel), trainer.max_tokens_per_micro_batch (packing), or recompute off if "
             "memory allows",
    "sync": "the sharded sync from several senders (weight_sync.sharded=on over NCCL, with "
            "weight_sync.stage_senders and pipeline parallelism or expert parallelism), fewer syncs (rl.mode async "
            "with rl.sync_every), or a faster link",
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
    sync = sync_estimate(cfg, arch, params).seconds
    rollout = max(samples * response / (ro.engine.num_engines * plan.decode_tokens_per_s),
                  ro.max_new_tokens / plan.request_tokens_per_s)
    reward = samples * plan.reward_s_per_sample / plan.reward_workers
    if sync is not None and cfg.rl.mode == "async":
        sync /= cfg.rl.sync_every  # its share per step
    return Walls(train=train, sync=sync, rollout=rollout, reward=reward, overlapped=cfg.rl.mode != "sync")


@dataclass(frozen=True, kw_only=True)
class SyncEstimate:
    """One sync's wire seconds (`sync_seconds`) both ways: `full` (weight_sync.sharded=off) and `sharded` (None:
    the sync cannot be sharded here: engines of one rank, DP attention); `route` of the sharded sync ("stages",
    "owned", or None: one sender) and its `senders`; `taken`: the one the config runs ("full" or "sharded");
    `seconds`: that one's (None: no estimate for the transport)."""
    full: float | None
    sharded: float | None = None
    route: str | None = None
    senders: int = 1
    taken: str = "full"

    @property
    def seconds(self) -> float | None:
        return self.sharded if self.taken == "sharded" else self.full


def sync_estimate(cfg, arch, params: ParamCount) -> SyncEstimate:
    """The sync both ways, full and sharded, and the one the config takes (`sharded_engine_tp`): wire seconds of
    broadcast or disk (the tensor transport has no wire: None), the model's bytes and each pipeline stage's
    (`ParamCount.rank` of one whole stage), the route's senders as `sync_route` picks them."""
    ws, par = cfg.weight_sync, cfg.parallel
    if ws.transport not in ("broadcast", "disk"):
        return SyncEstimate(full=None)
    from slimish.megatron_bridge.hf_config import pipeline_stage_layers

    plan = cfg.plan
    cluster = Cluster(nic_gbit_s=plan.nic_gbit_s, fs_write_gbyte_s=plan.fs_write_gbyte_s,
                      fs_read_gbyte_s=plan.fs_read_gbyte_s)
    dtype = DTYPE_BYTES[cfg.model.dtype]
    pp = par.pipeline_parallel
    split = pipeline_stage_layers(arch.num_layers, pp, first=par.first_stage_layers, last=par.last_stage_layers,
                                  virtual_pipeline=par.virtual_pipeline)
    stages = [StageBytes(dense=dense * dtype, experts=experts * dtype) for dense, experts in (
        params.rank(tensor_parallel=1, pipeline_parallel=pp, expert_parallel=1, expert_tensor_parallel=1, stage=s,
                    stage_layers=split) for s in range(pp))]
    common = dict(transport=ws.transport, cluster=cluster, pipeline_parallel=pp, stage_senders=ws.stage_senders,
                  expert_bytes=sum(params.experts_per_layer) * dtype, expert_parallel=par.expert_parallel,
                  expert_tensor_parallel=par.expert_tensor_parallel or par.tensor_parallel)
    full = sync_seconds(params.total * dtype, **common)
    shards = shardable_engine_tp(cfg)
    if shards == 1:
        return SyncEstimate(full=full)
    route = sync_route(cfg, arch)
    senders = 1 if route is None else pp * (par.expert_parallel if route == "owned" else 1)
    sharded = sync_seconds(params.total * dtype, **common, engine_shards=shards, route=route, stages=stages)
    return SyncEstimate(full=full, sharded=sharded, route=route, senders=senders,
                        taken="sharded" if sharded_engine_tp(cfg, arch) > 1 else "full")


def plan_backend(cfg) -> str:
    """The trainer's collectives' backend on the planned cluster: parallel.backend, 'auto' being NCCL (the plan is
    of GPU nodes) unless the engines run on the CPU."""
    backend = cfg.parallel.backend
    if backend != "auto":
        return backend
    return "gloo" if cfg.rollout.engine.device == "cpu" else "nccl"


def shardable_engine_tp(cfg) -> int:
    """The engines' tensor-parallel size where the sync can be sharded at all (a transport that sends shards, not
    DP attention), whatever weight_sync.sharded says; else 1."""
    engine = cfg.rollout.engine
    if cfg.weight_sync.transport not in SHARDED_TRANSPORTS or engine.attention_data_parallel > 1:
        return 1
    return engine.tensor_parallel


def sharded_engine_tp(cfg, arch) -> int:
    """The engines' tensor-parallel size where the sync would be sharded (weight_sync.sharded, as the sender decides
    it for the engines slimish starts, `WeightSender.sharded_layout`: 'on', or 'auto' with engines of more than one
    rank and a transport that shards under it, broadcast only on gloo: over NCCL 'auto' keeps the full path), else
    1. `arch`: the model (every family's layout is known)."""
    ws = cfg.weight_sync
    if ws.sharded == "off" or (ws.sharded == "auto" and ws.transport == "broadcast" and plan_backend(cfg) != "gloo"):
        return 1
    return shardable_engine_tp(cfg)


def sync_route(cfg, arch) -> str | None:
    """The sharded sync's senders, as `WeightSender._senders_route` picks them: "owned" with trainer expert
    parallelism where the owners fit (`owners_fit`: SGLang's CUDA checksum combines from parts hashed apart, so on
    GPU engines always; on CPU engines only where the engines' expert-parallel size is a multiple of the trainer's,
    or without checksums), "stages" with pipeline parallelism and weight_sync.stage_senders, else None (rank 0
    alone). The tensor transport's all-on-one-node condition is not checked (it has no wire estimate)."""
    par, ws, engine = cfg.parallel, cfg.weight_sync, cfg.rollout.engine
    ep = par.expert_parallel
    fits = (ep > 1 and arch.moe is not None and arch.moe.num_experts % ep == 0
            and (not ws.verify or engine.device != "cpu" or engine.expert_parallel % ep == 0))
    if fits:
        return "owned"
    return "stages" if par.pipeline_parallel > 1 and ws.stage_senders else None
