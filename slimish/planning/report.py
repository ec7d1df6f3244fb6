"""The text `slimish plan` prints: memory per GPU, seconds per wall, the binding wall and what to change."""

from __future__ import annotations

from slimish.config.validate import offload_fraction
from slimish.planning.memory import GB, colocated_gpu, engine_gpu, layout, trainer_rank
from slimish.planning.params import ParamCount, count_params
from slimish.planning.walls import ADVICE, COLOCATED_ADVICE, plan_backend, step_walls, sync_estimate


def plan_text(cfg, hf_config: dict) -> str:
    from slimish.megatron_bridge.hf_config import architecture_from_hf

    arch = architecture_from_hf(hf_config)
    params = count_params(hf_config)
    return "\n".join([*_header(cfg, arch, params), *_trainer(cfg, arch, params), *_engine(cfg, arch, params),
                      *_colocated(cfg, arch, params), *_walls(cfg, arch, params)])


def _expert_tensor(par) -> str:
    """", ETPn" where each expert is split other than tensor_parallel ways (parallel.expert_tensor_parallel)."""
    etp = par.expert_tensor_parallel
    return f", ETP{etp}" if etp and etp != par.tensor_parallel else ""


def _header(cfg, arch, params: ParamCount) -> list[str]:
    par, engine = cfg.parallel, cfg.rollout.engine
    cp = par.context_parallel
    dp = par.num_trainer_ranks // (par.tensor_parallel * par.pipeline_parallel * cp)
    return [f"model: {arch.family}, {params.total / 1e9:.2f}B parameters ({params.active / 1e9:.2f}B active per "
            f"token), {cfg.model.dtype}",
            f"layout: trainer {par.num_trainer_ranks} GPUs = TP{par.tensor_parallel} x PP{par.pipeline_parallel} x "
            + (f"CP{cp} x " if cp > 1 else "") + f"DP{dp} (EP{par.expert_parallel}{_expert_tensor(par)}); "
            f"engines {engine.num_engines} x TP{engine.tensor_parallel}"
            + (f", each over {engine.nodes_per_engine} nodes" if engine.nodes_per_engine > 1 else "")
            + (", on the trainer's GPUs (colocated)" if cfg.placement.colocate else ""),
            _lr_schedule(cfg)]


def _lr_schedule(cfg) -> str:
    """trainer.optimizer's schedule in words, in optimizer steps (`slimish/trainer/lr_schedule.py`)."""
    opt = cfg.trainer.optimizer
    total = cfg.rl.num_steps * cfg.trainer.num_minibatches
    text = f"lr: {opt.lr:g} over {total} optimizer steps ({cfg.trainer.num_minibatches} per RL step)"
    if opt.lr_warmup_steps:
        text += f", warm-up {opt.lr_warmup_steps} steps"
    if opt.lr_decay_style == "constant":
        return text + ", then constant" if opt.lr_warmup_steps else text + ", constant"
    return text + (f", then {opt.lr_decay_style} decay to {opt.lr * opt.min_lr_ratio:g} at step "
                   f"{opt.lr_decay_steps or total}")


def _gb(value: float) -> str:
    return f"{value / GB:8.1f}"


def _fits(total: float, limit_gb: float, fix: str) -> str:
    if total <= limit_gb * GB:
        return f"  total   {_gb(total)} GB of {limit_gb:g}: fits"
    return f"  total   {_gb(total)} GB of {limit_gb:g}: does NOT fit; {fix}"


ATTENTION_NOTE = {"te": "Transformer Engine's fused attention", "sdpa": "torch's scaled_dot_product_attention",
                  "local": "Megatron's DotProductAttention, [s, s] scores per head"}


def _trainer(cfg, arch, params: ParamCount) -> list[str]:
    tr, par = cfg.trainer, cfg.parallel
    mem = trainer_rank(cfg, arch, params, prompt_tokens=cfg.plan.prompt_tokens)
    distributed = "on" if tr.optimizer.distributed else "off"
    other_recompute = "none" if tr.recompute == "full" else "full"
    sp = layout(cfg).sequence_parallel
    fix = ("trainer.optimizer.distributed=true, " if not tr.optimizer.distributed else "") + \
          ("trainer.recompute=full, " if tr.recompute != "full" else "") + \
          ("trainer.optimizer.cpu_offload=true, " if tr.optimizer.distributed and cfg.model.dtype == "bfloat16"
           and offload_fraction(tr.optimizer.cpu_offload) < 1 else "") + \
          ("trainer.attention=auto (te) or sdpa, " if mem.attention == "local" else "") + \
          ("parallel.sequence_parallel=true, " if par.tensor_parallel > 1 and not sp else "") + \
          "more tensor or pipeline parallelism, or fewer tokens per micro-batch"
    if tr.attention == "auto":
        attention = "attention te, for trainer.attention auto: te on GPU nodes with Transformer Engine, sdpa holds " \
                    "the same"
    else:
        attention = f"attention {mem.attention}: {ATTENTION_NOTE[mem.attention]}"
    other = "te or sdpa" if mem.attention == "local" else "local"
    lines = ["", "trainer rank (the fullest pipeline stage), GB:",
             f"  weights {_gb(mem.weights)}",
             f"  grads   {_gb(mem.grads)}   (fp32)",
             f"  optim   {_gb(mem.optimizer)}   (distributed optimizer {distributed}; the other way: "
             f"{mem.optimizer_other / GB:.1f}" + (f"; in host memory, trainer.optimizer.cpu_offload: "
                                                   f"{mem.optimizer_host / GB:.1f} with its grads)"
                                                   if mem.optimizer_host else ")"),
             f"  activ   {_gb(mem.activations)}   (recompute {tr.recompute}, {mem.tokens} tokens per micro-batch, "
             f"sequence parallel {'on' if sp else 'off'}; recompute {other_recompute}: "
             f"{mem.activations_other / GB:.1f})",
             f"          {'':8}   ({attention}; {other}: {mem.activations_attention_other / GB:.1f})",
             f"  logits  {_gb(mem.logits)}   (chunks of {tr.logprob_chunk_tokens} tokens)"]
    if mem.reference:
        lines.append(f"  ref     {_gb(mem.reference)}   (reference model's weights, {cfg.model.dtype}; its forward, "
                     f"{mem.reference_activations / GB:.1f}, runs in turn with training)")
    if mem.critic:
        lines.append(f"  critic  {_gb(mem.critic)}   (ppo's value model: weights {mem.critic_weights / GB:.1f} + fp32 "
                     f"grads {mem.critic_grads / GB:.1f} + optim {mem.critic_optimizer / GB:.1f}; its activations, "
                     f"{mem.critic_activations / GB:.1f}, in turn with the policy's)")
    return [*lines, _fits(mem.total, cfg.plan.gpu_memory_gb, fix)]


def _engine(cfg, arch, params: ParamCount) -> list[str]:
    mem = engine_gpu(cfg, arch, params, prompt_tokens=cfg.plan.prompt_tokens)
    return ["", f"engine GPU (TP{cfg.rollout.engine.tensor_parallel}), GB:",
            f"  weights {_gb(mem.weights)}",
            f"  KV      {_gb(mem.kv_cache)}   ({mem.kv_tokens} tokens: its share of rollout.max_concurrency at full "
            "length, at most rollout.engine.max_total_tokens)",
            _fits(mem.total, cfg.plan.gpu_memory_gb, "more engine tensor parallelism, or lower "
                                                      "rollout.max_concurrency")]


def _colocated(cfg, arch, params: ParamCount) -> list[str]:
    """Colocated: what one GPU holds in each phase of a step (`memory.colocated_gpu`)."""
    if not cfg.placement.colocate:
        return []
    prompt = cfg.plan.prompt_tokens
    mem = colocated_gpu(cfg, trainer_rank(cfg, arch, params, prompt_tokens=prompt),
                        engine_gpu(cfg, arch, params, prompt_tokens=prompt))
    return ["", "colocated GPU (trainer rank and engine rank in turns), GB:",
            f"  generate {_gb(mem.generate)}   (the engine; the trainer offloaded)",
            f"  train    {_gb(mem.train)}   (the trainer rank; the engine released)",
            f"  sync     {_gb(mem.sync)}   (trainer weights, every role's, + engine weights + two "
            f"{cfg.weight_sync.bucket_mb:g} MiB buckets)",
            f"  host     {_gb(mem.host)}   (host memory per GPU the trainer offloads to: weights and optimizer "
            "state)",
            _fits(mem.peak, cfg.plan.gpu_memory_gb, "the fix of the phase that does not fit, above")]


def _walls(cfg, arch, params: ParamCount) -> list[str]:
    walls = step_walls(cfg, arch, params)
    lines = ["", "seconds per step:"]
    for name, seconds in walls.seconds().items():
        lines.append(f"  {name:<8}{seconds:9.1f}")
    if walls.sync is None:
        lines.append(f"  sync    (no estimate for weight_sync.transport {cfg.weight_sync.transport!r})")
    binding = walls.binding
    how = (f"generation overlapping training (rl.mode {cfg.rl.mode})" if walls.overlapped
           else "run one after another")
    lines.append(f"binding wall: {binding} ({walls.seconds()[binding]:.1f} s of {walls.step_seconds():.1f} s per "
                 f"step, {how}); to move it: {(COLOCATED_ADVICE if cfg.placement.colocate else ADVICE)[binding]}")
    return lines + (_sync_lines(cfg, arch, params) if walls.sync is not None else [])


ROUTE_WORDS = {"stages": "each pipeline stage's leader its stage (its experts, if any, gathered to it first)",
               "owned": "each stage's leader its stage outside the experts, each expert-parallel rank's owner its "
                        "own experts"}


def _sync_lines(cfg, arch, params: ParamCount) -> list[str]:
    """One sync's wire seconds both ways (`sync_estimate`): full, and sharded with its senders and route; which one
    the config takes, and, where it takes the full one but could shard, the setting that shards."""
    est = sync_estimate(cfg, arch, params)
    ws, plan = cfg.weight_sync, cfg.plan
    link = (f"{plan.nic_gbit_s:g} Gb/s per GPU" if ws.transport == "broadcast" else
            f"{plan.fs_write_gbyte_s:g} GB/s per writer, {plan.fs_read_gbyte_s:g} GB/s per reader")
    lines = ["", f"one {ws.transport} sync, wire seconds ({link}; docs/weight-sync.md, \"At scale, on paper\"):",
             f"  full    {est.full:9.1f}   (every engine rank receives the whole model)"]
    if est.sharded is None:
        return [*lines, "  sharded       -     (not here: engines of one rank, or DP attention)"]
    senders = ("one sender, trainer rank 0" if est.route is None else
               f"{est.senders} senders, route \"{est.route}\": {ROUTE_WORDS[est.route]}")
    lines.append(f"  sharded {est.sharded:9.1f}   (each engine rank its shard; {senders})")
    if est.taken == "sharded":
        return [*lines, f"  taken: sharded (weight_sync.sharded={ws.sharded})"]
    why = ("weight_sync.sharded=off; auto or on shards it" if ws.sharded == "off" else
           f"weight_sync.sharded=auto keeps the full path over {plan_backend(cfg).upper()}; on shards it")
    return [*lines, f"  taken: full ({why})"]
