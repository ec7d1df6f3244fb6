"""Cross-field checks on a built `JobConfig`. Each failure names the key and how to fix it; nothing is rewritten."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from urllib.parse import urlsplit

from slimish.config.errors import ConfigError
from slimish.config.schema import ESTIMATOR_MIN_GROUP_SIZE, JobConfig


def _shown(path: str) -> str:
    """A path as an error shows it: as given, and resolved when it was relative (to the current directory)."""
    if Path(path).is_absolute():
        return repr(path)
    return f"{path!r} (relative to the current directory: {Path(path).resolve()})"


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _check_rl_mode(cfg: JobConfig) -> None:
    rl, partial = cfg.rl, cfg.rollout.partial
    _positive("rl.sync_every", rl.sync_every)
    if rl.sync_every > 1 and rl.mode != "async":
        raise ConfigError("rl.sync_every", f"got {rl.sync_every}, but only rl.mode 'async' syncs less often than "
                                           f"every step (rl.mode is {rl.mode!r}); use 1 or rl.mode=async")
    if rl.mode == "async" and partial.mode != "retract":
        raise ConfigError("rl.mode", "'async' generates without stopping, which needs rollout.partial.mode 'retract' "
                                     f"(got {partial.mode!r}): set rollout.partial.mode=retract")
    # A group is at least this many versions old when it trains; a tighter bound would regenerate every group.
    least = {"sync": 0, "one_step_off": 1, "async": rl.sync_every}[rl.mode]
    if partial.max_staleness and partial.max_staleness < least:
        raise ConfigError("rollout.partial.max_staleness",
                          f"got {partial.max_staleness}, but with rl.mode {rl.mode!r}"
                          + (f" and rl.sync_every {rl.sync_every}" if rl.mode == "async" else "")
                          + f" a step trains tokens up to {least} version(s) old: use >= {least} (or 0, no bound)")


def _check_lr_schedule(cfg: JobConfig) -> None:
    opt = cfg.trainer.optimizer
    _positive("trainer.optimizer.lr_warmup_steps", opt.lr_warmup_steps, allow_zero=True)
    _positive("trainer.optimizer.lr_decay_steps", opt.lr_decay_steps, allow_zero=True)
    if not 0 <= opt.min_lr_ratio <= 1:
        raise ConfigError("trainer.optimizer.min_lr_ratio", f"must be in [0, 1] (a fraction of lr), got "
                                                            f"{opt.min_lr_ratio}")
    if opt.lr_decay_style == "constant":
        return
    total = cfg.rl.num_steps * cfg.trainer.num_minibatches
    decay = opt.lr_decay_steps or total
    if opt.lr_warmup_steps >= decay:
        where = (f"trainer.optimizer.lr_decay_steps ({decay})" if opt.lr_decay_steps else
                 f"the run's optimizer steps, rl.num_steps x trainer.num_minibatches ({total})")
        raise ConfigError("trainer.optimizer.lr_warmup_steps",
                          f"got {opt.lr_warmup_steps}, but {opt.lr_decay_style} decay must start before it ends at "
                          f"{where}: lower the warm-up, raise the decay steps, or use lr_decay_style=constant")


def offload_fraction(cpu_offload: bool | float) -> float:
    """The share of the optimizer's parameters trainer.optimizer.cpu_offload puts in host memory (true: all)."""
    return float(cpu_offload) if not isinstance(cpu_offload, bool) else (1.0 if cpu_offload else 0.0)


def _check_cpu_offload(cfg: JobConfig) -> None:
    """What Megatron-Core 0.16's CPU-offloading optimizer (HybridDeviceOptimizer) runs with: the distributed
    optimizer (it is built inside it), and bf16 parameters: it takes the distributed optimizer's shards of the
    parameters themselves, and an fp32 parameter's shard is a view it refuses ("can't optimize a non-leaf
    Tensor"). That it needs a GPU trainer is checked by the trainer (`slimish.trainer.model.wrap_for_training`)."""
    opt = cfg.trainer.optimizer
    if not offload_fraction(opt.cpu_offload):
        return
    if not opt.distributed:
        raise ConfigError("trainer.optimizer.cpu_offload", "needs Megatron's distributed optimizer, which the CPU "
                                                           "offload is built into: set trainer.optimizer.distributed="
                                                           "true")
    if cfg.model.dtype != "bfloat16":
        raise ConfigError("trainer.optimizer.cpu_offload", f"needs model.dtype=bfloat16 (got {cfg.model.dtype}): "
                                                           "Megatron-Core 0.16 offloads the fp32 main weights it keeps "
                                                           "for bf16 parameters, and refuses fp32 parameters")


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # run.name: the run directory's own name, nothing above it
# Numeric keys that may be negative; every other one must be >= 0 (and every one finite: `_check_numbers`).
MAY_BE_NEGATIVE = {"reward.failure_reward"}
# Numeric keys that are fractions: (low, high, whether high itself is allowed).
FRACTIONS = {
    "trainer.optimizer.adam_beta1": (0.0, 1.0, False), "trainer.optimizer.adam_beta2": (0.0, 1.0, False),
    "trainer.critic.gamma": (0.0, 1.0, True), "trainer.critic.lam": (0.0, 1.0, True),
    "eval.pass_threshold": (0.0, 1.0, True), "plan.mfu": (0.0, 1.0, True),
    "trainer.optimizer.cpu_offload": (0.0, 1.0, True),
}


def _numbers(node, prefix: str = ""):
    """(dotted key, value) of every int and float field of a config dataclass tree."""
    for field in dataclasses.fields(node):
        value, key = getattr(node, field.name), f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            yield from _numbers(value, f"{key}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield key, value
        elif isinstance(value, list):
            for k, item in enumerate(value):
                if isinstance(item, (int, float)) and not isinstance(item, bool):
                    yield f"{key}[{k}]", item


def _check_numbers(cfg: JobConfig) -> None:
    """Every numeric key finite (a NaN or an inf learning rate, temperature or timeout never reaches the job) and
    the fractions in their range. Run first; `_check_not_negative` runs last, so that a key with a rule of its own
    (> 0, a port's range) reports a negative value by that rule."""
    for key, value in _numbers(cfg):
        if not math.isfinite(value):
            raise ConfigError(key, f"must be a finite number, got {value}")
        base = key.split("[")[0]
        if base in FRACTIONS:
            low, high, closed = FRACTIONS[base]
            if not (low <= value <= high if closed else low <= value < high):
                raise ConfigError(key, f"must be in [{low:g}, {high:g}{']' if closed else ')'}, got {value}")


def _check_not_negative(cfg: JobConfig) -> None:
    """Every numeric key but MAY_BE_NEGATIVE >= 0 (those without a rule of their own: `_check_numbers`)."""
    for key, value in _numbers(cfg):
        if value < 0 and key.split("[")[0] not in MAY_BE_NEGATIVE:
            raise ConfigError(key, f"must be >= 0, got {value}")


# The transports that can send each engine rank its own shard (`Transport.shards` in slimish.weight_sync).
SHARDED_TRANSPORTS = ("tensor", "disk", "broadcast")


def _check_sharded_sync(cfg: JobConfig) -> None:
    """weight_sync.sharded 'on' where the sharded sync cannot run, known before any engine starts (the engines'
    layout is checked when the sync connects)."""
    ws = cfg.weight_sync
    if ws.sharded != "on":
        return
    if ws.transport not in SHARDED_TRANSPORTS:
        raise ConfigError("weight_sync.sharded", f"'on' needs weight_sync.transport in {list(SHARDED_TRANSPORTS)}; "
                                                 f"'{ws.transport}' sends the whole model to every engine rank: use "
                                                 "'auto' or 'off'")
    if cfg.rollout.engine.attention_data_parallel > 1:
        raise ConfigError("weight_sync.sharded", "'on' does not know the engine layout under DP attention "
                                                 "(rollout.engine.attention_data_parallel > 1): use 'auto' or 'off'")


def validate(cfg: JobConfig, *, files: bool = True, isolate_hooks: bool = False) -> None:
    """Every check; with files=False, only config.json of the model is read (no weights, no data: `slimish plan`).
    `isolate_hooks`: import the hooks in a process of their own (the CLI's check-config and train), not here."""
    _check_numbers(cfg)
    if not RUN_NAME.fullmatch(cfg.run.name):  # (it starts with a letter or digit: never "." or "..")
        raise ConfigError("run.name", f"got {cfg.run.name!r}; a plain name (letters, digits, '.', '_', '-'), the "
                                      "run directory under run.output_dir")
    if not cfg.run.output_dir:
        raise ConfigError("run.output_dir", "is required: the directory the run directory goes under")
    if Path(cfg.run.output_dir).exists() and not Path(cfg.run.output_dir).is_dir():
        raise ConfigError("run.output_dir", f"{_shown(cfg.run.output_dir)} is a file, not a directory")
    if not cfg.data.prompt_key:
        raise ConfigError("data.prompt_key", "is required: the dataset column that holds the prompt")
    if cfg.sft.steps and cfg.sft.batch_size == 0:
        raise ConfigError("sft.batch_size", "must be > 0 with sft.steps > 0, got 0")
    _check_sharded_sync(cfg)
    ro, tr, par = cfg.rollout, cfg.trainer, cfg.parallel
    for key, value in [
        ("sft.lr", cfg.sft.lr),
        ("trainer.critic.lr", tr.critic.lr),
        ("rollout.request_timeout_s", ro.request_timeout_s),
        ("rollout.engine.startup_timeout_s", ro.engine.startup_timeout_s),
        ("rollout.engine.hang_timeout_s", ro.engine.hang_timeout_s),
        ("ray.placement_timeout_s", cfg.ray.placement_timeout_s),
        ("rollout.prompts_per_step", ro.prompts_per_step),
        ("rollout.samples_per_prompt", ro.samples_per_prompt),
        ("rollout.max_new_tokens", ro.max_new_tokens),
        ("rollout.max_concurrency", ro.max_concurrency),
        ("rollout.engine.num_engines", ro.engine.num_engines),
        ("rollout.engine.tensor_parallel", ro.engine.tensor_parallel),
        ("rollout.engine.max_total_tokens", ro.engine.max_total_tokens),
        ("trainer.micro_batch_size", tr.micro_batch_size),
        ("trainer.num_minibatches", tr.num_minibatches),
        ("trainer.logprob_chunk_tokens", tr.logprob_chunk_tokens),
        ("trainer.torch_threads", tr.torch_threads),
        ("trainer.optimizer.lr", tr.optimizer.lr),
        ("parallel.tensor_parallel", par.tensor_parallel),
        ("parallel.pipeline_parallel", par.pipeline_parallel),
        ("parallel.expert_parallel", par.expert_parallel),
        ("parallel.num_trainer_ranks", par.num_trainer_ranks),
        ("weight_sync.bucket_mb", cfg.weight_sync.bucket_mb),
        ("weight_sync.bucket_timeout_s", cfg.weight_sync.bucket_timeout_s),
        ("weight_sync.min_bandwidth_mib_s", cfg.weight_sync.min_bandwidth_mib_s),
        ("rl.num_steps", cfg.rl.num_steps),
        ("run.log_every", cfg.run.log_every),
        ("rollout.temperature", ro.temperature),
    ]:
        _positive(key, value)
    _positive("sft.steps", cfg.sft.steps, allow_zero=True)
    _positive("trainer.loss.kl_coef", tr.loss.kl_coef, allow_zero=True)
    _positive("trainer.max_tokens_per_micro_batch", tr.max_tokens_per_micro_batch, allow_zero=True)
    _positive("trainer.max_skipped_steps", tr.max_skipped_steps, allow_zero=True)
    _positive("ray.num_cpus", cfg.ray.num_cpus, allow_zero=True)
    _positive("ray.cpus_per_slot", cfg.ray.cpus_per_slot)
    for key in ("gpu_memory_gb", "gpu_tflops", "mfu", "nic_gbit_s", "fs_write_gbyte_s", "fs_read_gbyte_s",
                "decode_tokens_per_s", "request_tokens_per_s", "reward_workers"):
        _positive(f"plan.{key}", getattr(cfg.plan, key))
    for key in ("prompt_tokens", "mean_response_tokens", "reward_s_per_sample"):
        _positive(f"plan.{key}", getattr(cfg.plan, key), allow_zero=True)
    _positive("checkpoint.save_every", cfg.checkpoint.save_every, allow_zero=True)
    _positive("checkpoint.keep_last", cfg.checkpoint.keep_last, allow_zero=True)
    _positive("checkpoint.signal_grace_s", cfg.checkpoint.signal_grace_s)
    _positive("rollout.partial.over_sampling", ro.partial.over_sampling, allow_zero=True)
    _positive("rollout.max_retries", ro.max_retries, allow_zero=True)
    _positive("rollout.engine.watch_interval_s", ro.engine.watch_interval_s)
    _positive("rollout.partial.max_staleness", ro.partial.max_staleness, allow_zero=True)
    _positive("trainer.loss.tis_cap", tr.loss.tis_cap, allow_zero=True)
    _positive("reward.timeout_s", cfg.reward.timeout_s, allow_zero=True)
    _positive("reward.workers", cfg.reward.workers, allow_zero=True)
    if ro.overlong.mode == "penalty" and not 0 < ro.overlong.buffer_tokens <= ro.max_new_tokens:
        raise ConfigError("rollout.overlong.buffer_tokens",
                          f"got {ro.overlong.buffer_tokens}; with rollout.overlong.mode 'penalty' it must be in "
                          f"1..rollout.max_new_tokens ({ro.max_new_tokens})")
    _positive("rollout.overlong.penalty_factor", ro.overlong.penalty_factor, allow_zero=True)
    _positive("rollout.dynamic_sampling.max_extra_groups", ro.dynamic_sampling.max_extra_groups, allow_zero=True)
    if ro.partial.mode == "off" and ro.partial.over_sampling:
        raise ConfigError("rollout.partial.over_sampling",
                          f"got {ro.partial.over_sampling}, but groups beyond prompts_per_step are only kept with "
                          "rollout.partial.mode 'abort' or 'retract'; use 0 or set the mode")
    _check_rl_mode(cfg)
    _check_lr_schedule(cfg)
    _check_cpu_offload(cfg)
    if ro.top_p != 1:
        # SGLang samples from the top-p-truncated distribution but returns the logprobs of the untruncated
        # softmax(logits / T): every importance ratio and the parity metric would compare the wrong policy.
        raise ConfigError("rollout.top_p", f"got {ro.top_p}; only 1.0 is supported: SGLang reports logprobs of the "
                          "untruncated distribution, not of the top-p one it samples from (use rollout.temperature "
                          "to sharpen sampling)")
    for key, eps in [("trainer.loss.clip_eps_low", tr.loss.clip_eps_low),
                     ("trainer.loss.clip_eps_high", tr.loss.clip_eps_high)]:
        if not 0 < eps < 1:
            raise ConfigError(key, f"must be in (0, 1), got {eps}")

    min_group_size = ESTIMATOR_MIN_GROUP_SIZE[tr.loss.advantage_estimator]
    if ro.samples_per_prompt < min_group_size:
        raise ConfigError("rollout.samples_per_prompt",
                          f"{tr.loss.advantage_estimator} takes a baseline within each group and needs >= "
                          f"{min_group_size} samples, got {ro.samples_per_prompt}")
    _positive("trainer.loss.reward_kl_coef", tr.loss.reward_kl_coef, allow_zero=True)
    _positive("trainer.loss.mis_low", tr.loss.mis_low, allow_zero=True)
    if tr.loss.mis_high and not tr.loss.mis_low <= 1.0 <= tr.loss.mis_high:
        raise ConfigError("trainer.loss.mis_high",
                          f"the band [mis_low, mis_high] = [{tr.loss.mis_low}, {tr.loss.mis_high}] must hold 1 (an "
                          "on-policy token); e.g. mis_low=0.5 mis_high=2")
    batch = ro.prompts_per_step * ro.samples_per_prompt
    if batch % tr.num_minibatches:
        raise ConfigError("trainer.num_minibatches",
                          f"must divide prompts_per_step * samples_per_prompt = {batch}, got {tr.num_minibatches}")
    _positive("parallel.context_parallel", par.context_parallel)
    _positive("parallel.virtual_pipeline", par.virtual_pipeline)
    model_parallel = par.tensor_parallel * par.pipeline_parallel * par.context_parallel
    if par.num_trainer_ranks % model_parallel:
        raise ConfigError("parallel.num_trainer_ranks",
                          f"must be a multiple of tensor_parallel * pipeline_parallel * context_parallel = "
                          f"{model_parallel}, got {par.num_trainer_ranks}")
    data_parallel = par.num_trainer_ranks // model_parallel
    minibatch = batch // tr.num_minibatches
    if minibatch % data_parallel:
        raise ConfigError("parallel.num_trainer_ranks",
                          f"the minibatch of {minibatch} sequences must split evenly over {data_parallel} "
                          "data-parallel ranks")
    if cfg.sft.steps and cfg.sft.batch_size % data_parallel:
        raise ConfigError("sft.batch_size", f"must split evenly over {data_parallel} data-parallel ranks, got "
                                            f"{cfg.sft.batch_size}")

    _check_attach(ro.engine, files=files)
    _check_colocate(cfg)
    _check_ports(cfg)

    if files:
        _check_paths(cfg)
    else:
        _check_plan_model(cfg.model.hf_path)
    _check_resume(cfg.checkpoint.resume)
    _check_layout(cfg)
    _check_expert_parallel(cfg, data_parallel)
    _check_serving(cfg)
    _check_reward(cfg.reward, isolate_hooks)
    _positive("eval.every", cfg.eval.every, allow_zero=True)
    _positive("eval.samples_per_prompt", cfg.eval.samples_per_prompt)
    _positive("eval.max_prompts", cfg.eval.max_prompts, allow_zero=True)
    if cfg.run.phase_hook:
        _check_hook("run.phase_hook", cfg.run.phase_hook, "phase", isolate_hooks)
    for key, kind in (("after_bucket_hook", "after_bucket"), ("in_flight_hook", "in_flight")):
        if getattr(cfg.weight_sync, key):
            _check_hook(f"weight_sync.{key}", getattr(cfg.weight_sync, key), kind, isolate_hooks)
    if cfg.rollout.generate_fn:
        _check_hook("rollout.generate_fn", cfg.rollout.generate_fn, "program", isolate_hooks)
    _check_not_negative(cfg)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")
ROWS_CHECKED = 64  # the first rows of each jsonl dataset that check-config reads


def _check_plan_model(path: str) -> None:
    """What `slimish plan` reads for the model: its directory, its config.json alone, or a known model's name."""
    from slimish.megatron_bridge.known_models import KNOWN, known_config

    hf = Path(path)
    if (hf / "config.json").is_file() or (hf.is_file() and hf.suffix == ".json"):
        return
    if not hf.exists() and known_config(path) is not None:
        return
    raise ConfigError("model.hf_path", f"{_shown(path)} has no config.json; to plan before the download, give the "
                      f"model's config.json alone or a known model: {', '.join(KNOWN)}")


def _check_paths(cfg: JobConfig) -> None:
    if not cfg.model.hf_path:
        raise ConfigError("model.hf_path", "is required: a Hugging Face checkpoint directory")
    if Path(cfg.model.hf_path).is_file():
        raise ConfigError("model.hf_path", f"{_shown(cfg.model.hf_path)} is a file: give the model's directory (the "
                                           "one holding config.json)")
    if not (Path(cfg.model.hf_path) / "config.json").is_file():
        raise ConfigError("model.hf_path", f"{_shown(cfg.model.hf_path)} has no config.json")
    _check_model(cfg.model.hf_path)
    if cfg.model.megatron_path:
        _check_megatron_path(cfg.model.megatron_path, cfg.model.hf_path)
    if not any((Path(cfg.model.hf_path) / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError("model.hf_path", f"{_shown(cfg.model.hf_path)} has no tokenizer ({', '.join(TOKENIZER_FILES)}"
                                           "): copy the model's tokenizer files beside its weights")
    if not cfg.data.path:
        raise ConfigError("data.path", "is required: a jsonl file of prompts")
    if not Path(cfg.data.path).exists():
        raise ConfigError("data.path", f"{_shown(cfg.data.path)} does not exist")
    _check_rows("data.path", cfg.data.path, prompt_key=cfg.data.prompt_key)
    if cfg.eval.every > 0 and not cfg.eval.data_path:
        raise ConfigError("eval.data_path", "is required when eval.every > 0: a file of held-out prompts")
    for key, path in [("eval.data_path", cfg.eval.data_path)] + [
            (f"eval.more_data_paths[{k}]", p) for k, p in enumerate(cfg.eval.more_data_paths)]:
        if cfg.eval.every > 0 and path and not Path(path).exists():
            raise ConfigError(key, f"{_shown(path)} does not exist")
        if cfg.eval.every > 0 and path:
            _check_rows(key, path, prompt_key=cfg.data.prompt_key)
    if cfg.sft.steps > 0 and not Path(cfg.sft.data_path).is_file():
        raise ConfigError("sft.data_path", f"sft.steps > 0 needs a jsonl file, {_shown(cfg.sft.data_path)} does not "
                                           "exist")
    if cfg.sft.steps > 0:
        _check_rows("sft.data_path", cfg.sft.data_path, prompt_key="prompt", sft=True)


def _check_rows(key: str, path: str, *, prompt_key: str, sft: bool = False) -> None:
    """The first ROWS_CHECKED rows of a jsonl dataset as the job will read them (`slimish.rollout.data`): JSON
    objects whose prompt is text or a list of chat messages; SFT rows with their "response" (or "turns"). Other
    formats (Parquet, a saved dataset) are read by the job at its start, which checks every row the same way."""
    from slimish.data_rows import DataError, check_prompt_row, check_sft_row, first_jsonl_rows

    if Path(path).is_dir():
        if not any((Path(path) / name).is_file() for name in ("dataset_dict.json", "dataset_info.json")):
            raise ConfigError(key, f"{_shown(path)} is a directory but not a dataset saved with save_to_disk (no "
                                   "dataset_dict.json or dataset_info.json)")
        return
    if Path(path).suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            pq.read_metadata(path)
        except Exception as exc:  # noqa: BLE001 - whatever pyarrow finds wrong with the file
            raise ConfigError(key, f"{_shown(path)} is not a readable Parquet file: {exc}") from None
        return
    if Path(path).suffix != ".jsonl":
        return
    try:
        rows = first_jsonl_rows(path, ROWS_CHECKED)
        if not rows:
            raise DataError(f"{path}: no rows")
        for lineno, row in rows:
            (check_sft_row if sft else check_prompt_row)(row, f"{path}:{lineno}", prompt_key)
    except DataError as exc:
        raise ConfigError(key, str(exc)) from None
    except UnicodeDecodeError:
        raise ConfigError(key, f"{path} is not UTF-8 text") from None


# Megatron-Core 0.16's local MLA spec (column-parallel down projections) keeps each tensor-parallel rank's own part of
# the rotary key's gradient only: at TP2 the kv down projection ended a step 0.015 from the one-rank step's.
MLA_LOCAL_SPEC_AT_TP = ("multi-latent attention at tensor_parallel > 1 trains correctly only with Transformer Engine's "
                        "layer spec: use trainer.attention=te (or auto on GPUs with TE), or tensor_parallel 1")


def _check_layout(cfg: JobConfig) -> None:
    """What Megatron and SGLang can split: attention heads and KV heads by tensor parallelism (trainer and
    engines), layers by pipeline parallelism (evenly, or with parallel.first_stage_layers / last_stage_layers)."""
    from slimish.megatron_bridge.hf_config import architecture_from_hf, pipeline_stage_layers, read_hf_config

    arch = architecture_from_hf(read_hf_config(cfg.model.hf_path))
    ro = cfg.rollout
    if ro.max_new_tokens >= arch.max_position_embeddings:
        raise ConfigError("rollout.max_new_tokens", f"got {ro.max_new_tokens}; the model takes at most "
                                                    f"{arch.max_position_embeddings} positions, prompt included")
    if ro.engine.max_total_tokens <= ro.max_new_tokens:
        raise ConfigError("rollout.engine.max_total_tokens", f"got {ro.engine.max_total_tokens}; an engine's KV cache "
                                                             f"must hold a prompt and rollout.max_new_tokens "
                                                             f"({ro.max_new_tokens}) at least")
    heads, kv = arch.num_attention_heads, arch.num_query_groups
    tp, pp = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel
    if heads % tp:
        raise ConfigError("parallel.tensor_parallel", f"got {tp}; it must divide the model's {heads} attention heads")
    if arch.mla is None and kv % tp:
        raise ConfigError("parallel.tensor_parallel", f"got {tp}; it must divide the model's {kv} KV heads "
                                                      "(num_key_value_heads)")
    if arch.moe is not None and tp > 1 and not cfg.parallel.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel", f"got false with tensor_parallel {tp}: Megatron trains a "
                                                        "mixture-of-experts model at tensor_parallel > 1 only with "
                                                        "sequence parallelism; set it true")
    if cfg.parallel.context_parallel > 1 and cfg.trainer.attention == "local":
        raise ConfigError("trainer.attention", "got local with parallel.context_parallel > 1: Megatron's "
                                               "DotProductAttention refuses context parallelism; use sdpa, te or auto")
    if arch.mla is not None and tp > 1 and cfg.trainer.attention in ("sdpa", "local"):
        raise ConfigError("trainer.attention", f"got {cfg.trainer.attention} with tensor_parallel {tp}: "
                                               f"{MLA_LOCAL_SPEC_AT_TP}")
    _check_recompute(cfg.trainer, arch)
    try:  # the stages first, then their virtual chunks: an error names the key that broke the split
        pipeline_stage_layers(arch.num_layers, pp, first=cfg.parallel.first_stage_layers,
                              last=cfg.parallel.last_stage_layers)
        pipeline_stage_layers(arch.num_layers, pp, first=cfg.parallel.first_stage_layers,
                              last=cfg.parallel.last_stage_layers, virtual_pipeline=cfg.parallel.virtual_pipeline)
    except ValueError as exc:
        key = "parallel.pipeline_parallel" if not (cfg.parallel.first_stage_layers or cfg.parallel.last_stage_layers) \
            else "parallel.first_stage_layers"
        if "virtual" in str(exc):
            key = "parallel.virtual_pipeline"
        raise ConfigError(key, f"got pipeline_parallel {pp}: {exc}") from None
    engine_tp = cfg.rollout.engine.tensor_parallel
    if heads % engine_tp:
        raise ConfigError("rollout.engine.tensor_parallel", f"got {engine_tp}; it must divide the model's {heads} "
                                                            "attention heads")
    if arch.mla is None and kv % engine_tp and engine_tp % kv:
        raise ConfigError("rollout.engine.tensor_parallel", f"got {engine_tp}; with the model's {kv} KV heads it must "
                                                            "divide them or be a multiple of them (SGLang replicates)")


def _check_recompute(tr, arch) -> None:
    """trainer.recompute_modules: read at trainer.recompute=selective only, and what Megatron builds for the model."""
    modules = tr.recompute_modules
    if tr.recompute != "selective":
        if modules != ["core_attn"]:
            raise ConfigError("trainer.recompute_modules", f"got {modules}, read only with trainer.recompute=selective "
                                                           f"(it is {tr.recompute!r}): set trainer.recompute=selective "
                                                           "or leave the modules out")
        return
    if not modules:
        raise ConfigError("trainer.recompute_modules", "is empty: with trainer.recompute=selective name what to "
                                                       "recompute, e.g. [core_attn]")
    if "mla_up_proj" in modules and arch.mla is None:
        raise ConfigError("trainer.recompute_modules", "mla_up_proj recomputes multi-latent attention's up "
                                                       "projections, which this model has none of: leave it out")


def _check_model(path: str) -> None:
    """The bridge can build the model of config.json, and the safetensors headers read whole (cheap: no weights are
    loaded), so that a wrong or damaged model directory is reported here rather than by a trainer rank or an
    engine after start-up."""
    from slimish.megatron_bridge.errors import CheckpointError, UnsupportedConfig
    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.megatron_bridge.hf_io import HFCheckpoint

    try:
        config = read_hf_config(path)
        architecture_from_hf(config)
        HFCheckpoint(path)
    except (UnsupportedConfig, CheckpointError) as exc:
        raise ConfigError("model.hf_path", str(exc)) from None
    if config.get("quantization_config"):
        # The trainer would read it (dequantized), but the engines would serve FP8 layers that weight sync's bf16
        # tensors cannot update (each block's scale would stay the checkpoint's).
        raise ConfigError("model.hf_path", f"{_shown(path)} is an FP8 checkpoint, which the rollout engines would "
                          "serve in FP8 and weight sync cannot update; write a bf16 copy with `slimish convert "
                          "dequantize --hf DIR --out DIR` and point model.hf_path at it")


def _check_megatron_path(path: str, hf_path: str) -> None:
    """model.megatron_path is a torch_dist checkpoint of the model of model.hf_path (its metadata only is read)."""
    from slimish.megatron_bridge.errors import CheckpointError
    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.megatron_bridge.initial_weights import check_megatron_checkpoint

    try:
        check_megatron_checkpoint(path, architecture_from_hf(read_hf_config(hf_path)), hf_path)
    except CheckpointError as exc:
        raise ConfigError("model.megatron_path", str(exc)) from None


def _check_resume(resume: str) -> None:
    from slimish.run_layout import is_complete

    if resume in ("auto", "never"):
        return
    if not resume:
        raise ConfigError("checkpoint.resume", "must be 'auto', 'never' or a checkpoint directory, got ''")
    if not is_complete(Path(resume)):
        raise ConfigError("checkpoint.resume", f"{_shown(resume)} is not a complete checkpoint (a step_<N> directory "
                                               "holding driver.json and trainer/); use 'auto', 'never' or such a path")


def _check_expert_parallel(cfg: JobConfig, data_parallel: int) -> None:
    """Expert parallelism splits a mixture-of-experts model's experts, expert tensor parallelism each expert's
    weights; Megatron lays the experts' ETP x EP x PP model-parallel groups over the trainer's ranks, the rest being
    the experts' data parallelism (`initialize_model_parallel`: the world must be a multiple of ETP x EP x PP).
    (`_check_model` has already shown that the bridge reads config.json.)"""
    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config

    par = cfg.parallel
    ep, etp = par.expert_parallel, par.expert_tensor_parallel
    _positive("parallel.expert_tensor_parallel", etp, allow_zero=True)
    if ep == 1 and etp in (0, par.tensor_parallel):
        return
    key, size = ("parallel.expert_parallel", ep) if ep != 1 else ("parallel.expert_tensor_parallel", etp)
    moe = architecture_from_hf(read_hf_config(cfg.model.hf_path)).moe
    if moe is None:
        what = "expert parallelism" if ep != 1 else "expert tensor parallelism other than tensor_parallel"
        raise ConfigError(key, f"got {size}; {what} needs a mixture-of-experts model, {cfg.model.hf_path!r} is "
                               f"dense: use {1 if ep != 1 else 0}")
    if moe.num_experts % ep:
        raise ConfigError("parallel.expert_parallel", f"must divide the model's {moe.num_experts} experts, got {ep}")
    etp = etp or par.tensor_parallel
    if moe.ffn_hidden_size % etp:
        raise ConfigError("parallel.expert_tensor_parallel", f"got {etp}; it must divide each expert's "
                                                             f"{moe.ffn_hidden_size} hidden units "
                                                             "(moe_intermediate_size)")
    expert_model = etp * ep * par.pipeline_parallel
    if par.num_trainer_ranks % expert_model:
        if par.expert_tensor_parallel in (0, par.tensor_parallel):
            raise ConfigError("parallel.expert_parallel",
                              f"must divide the data-parallel size num_trainer_ranks / (tensor_parallel * "
                              f"pipeline_parallel * context_parallel) = {data_parallel}, got {ep}")
        raise ConfigError("parallel.expert_tensor_parallel",
                          f"got {etp}: Megatron needs num_trainer_ranks ({par.num_trainer_ranks}) to be a multiple "
                          f"of expert_tensor_parallel * expert_parallel * pipeline_parallel = {etp} * {ep} * "
                          f"{par.pipeline_parallel} = {expert_model}")


def _check_serving(cfg: JobConfig) -> None:
    """The engines' serving options (`slimish.config.engine_flags`): sizes SGLang accepts, and no two settings that
    contradict each other (SGLang would override one, or fail at start or at its first forward)."""
    from slimish.config.engine_flags import A2A_BACKENDS, flags_set_twice

    engine = cfg.rollout.engine
    tp, ep, attn_dp = engine.tensor_parallel, engine.expert_parallel, engine.attention_data_parallel
    _positive("rollout.engine.expert_parallel", ep)
    _positive("rollout.engine.attention_data_parallel", attn_dp)
    _positive("rollout.engine.cuda_graph_max_bs", engine.cuda_graph_max_bs, allow_zero=True)
    _check_nodes_per_engine(cfg)
    for key, size in (("expert_parallel", ep), ("attention_data_parallel", attn_dp)):
        if tp % size:
            raise ConfigError(f"rollout.engine.{key}", f"must divide rollout.engine.tensor_parallel ({tp}), got {size}")
    if engine.moe_a2a_backend not in A2A_BACKENDS:
        raise ConfigError("rollout.engine.moe_a2a_backend",
                          f"got {engine.moe_a2a_backend!r}; SGLang's are {', '.join(A2A_BACKENDS)}")
    if engine.moe_a2a_backend != "none" and ep != tp:
        raise ConfigError("rollout.engine.expert_parallel",
                          f"got {ep}, but the all-to-all backend {engine.moe_a2a_backend!r} spans every rank of an "
                          f"engine (SGLang would set --ep-size to {tp}): set rollout.engine.expert_parallel={tp}")
    if not 0 <= engine.mem_fraction_static < 1:
        raise ConfigError("rollout.engine.mem_fraction_static",
                          f"must be in (0, 1) (0: SGLang's choice), got {engine.mem_fraction_static}")
    if (ep > 1 or engine.moe_a2a_backend != "none") and engine.device == "cpu":
        raise ConfigError("rollout.engine.expert_parallel",
                          f"got {ep} on rollout.engine.device 'cpu': SGLang 0.5.23's CPU MoE fails at its first "
                          "forward with expert parallelism; use 1 (and moe_a2a_backend 'none') on the CPU")
    for key, flag in flags_set_twice(engine):
        raise ConfigError("rollout.engine.extra_args",
                          f"sets {flag}, which rollout.engine.{key} sets: drop it from extra_args and set the key")
    if engine.extra_args and not engine.attach:
        from slimish.config.engine_flags import extra_args_problem

        problem = extra_args_problem(engine.extra_args)
        if problem:
            raise ConfigError("rollout.engine.extra_args", problem)
    if ep > 1 or engine.moe_a2a_backend != "none":
        from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config

        moe = architecture_from_hf(read_hf_config(cfg.model.hf_path)).moe
        key = "expert_parallel" if ep > 1 else "moe_a2a_backend"
        if moe is None:
            raise ConfigError(f"rollout.engine.{key}", f"needs a mixture-of-experts model; {cfg.model.hf_path!r} is "
                                                       "dense: leave it at its default")
        if moe.num_experts % ep:
            raise ConfigError("rollout.engine.expert_parallel",
                              f"must divide the model's {moe.num_experts} experts, got {ep}")


def _check_nodes_per_engine(cfg: JobConfig) -> None:
    """An engine over several nodes: whole ranks on each node, placed by this job, fed weights by a transport that
    reaches other nodes."""
    engine, nodes = cfg.rollout.engine, cfg.rollout.engine.nodes_per_engine
    _positive("rollout.engine.nodes_per_engine", nodes)
    if nodes == 1:
        return
    if engine.tensor_parallel % nodes:
        raise ConfigError("rollout.engine.nodes_per_engine",
                          f"must divide rollout.engine.tensor_parallel ({engine.tensor_parallel}), got {nodes}: "
                          "each node holds tensor_parallel / nodes_per_engine of an engine's ranks")
    if engine.attach:
        raise ConfigError("rollout.engine.nodes_per_engine",
                          f"got {nodes}, but attached engines run outside the job, which does not place them: "
                          "start them with --nnodes yourself and leave nodes_per_engine at 1")
    if cfg.weight_sync.transport == "tensor":
        raise ConfigError("weight_sync.transport",
                          f"'tensor' hands every engine rank handles to memory on the sender's node, which the "
                          f"ranks of an engine spanning {nodes} nodes cannot open: use 'broadcast' (or 'disk' on "
                          "storage every node reads)")
    if cfg.placement.colocate:
        raise ConfigError("placement.colocate", f"colocated engines are one GPU each; an engine spanning {nodes} "
                                                "nodes cannot be: set rollout.engine.nodes_per_engine=1")


def _check_reward(reward, isolate_hooks: bool) -> None:
    if not (reward.fn or reward.fns or reward.url):
        raise ConfigError("reward.fn", "is required (or reward.fns / reward.url): a dotted path such as "
                                       "'package.module.function'")
    if reward.fn:
        _check_hook("reward.fn", reward.fn, "reward", isolate_hooks)
    for k, dotted in enumerate(reward.fns):
        _check_hook(f"reward.fns[{k}]", dotted, "reward", isolate_hooks)
    terms = bool(reward.fn) + len(reward.fns) + bool(reward.url)
    if reward.weights and len(reward.weights) != terms:
        raise ConfigError("reward.weights", f"got {len(reward.weights)} weights for {terms} reward terms (reward.fn, "
                                            "reward.fns, reward.url in that order); give one each or none")
    if reward.url and (not reward.url.startswith(("http://", "https://")) or not urlsplit(reward.url).hostname):
        raise ConfigError("reward.url", f"got {reward.url!r}; expected an http:// or https:// URL with a host")
    for key in ("max_concurrency", "batch_size", "request_timeout_s"):
        _positive(f"reward.{key}", getattr(reward, key))
    _positive("reward.retries", reward.retries, allow_zero=True)


def _check_hook(key: str, dotted: str, kind: str, isolate: bool) -> None:
    """The hook `dotted` imports and can be called as a hook of `kind` is (`slimish.hooks.check_signature`);
    `isolate`: checked in a process of its own (`check_in_subprocess`), so that nothing of it runs here."""
    from slimish.hooks import HookError, check_in_subprocess, check_signature, load_function

    if not dotted:
        raise ConfigError(key, "is required: a dotted path such as 'package.module.function'")
    try:
        if isolate:
            check_in_subprocess(dotted, kind)
        else:
            check_signature(load_function(dotted), kind, dotted)
    except HookError as exc:
        raise ConfigError(key, str(exc)) from None


def _check_colocate(cfg: JobConfig) -> None:
    """Colocation: each GPU holds one trainer rank and one engine rank, which take turns on it (see
    `slimish.orchestration.colocation`)."""
    if not cfg.placement.colocate:
        return
    engine, ranks = cfg.rollout.engine, cfg.parallel.num_trainer_ranks
    if cfg.weight_sync.transport == "broadcast":
        raise ConfigError("weight_sync.transport", "'broadcast' cannot run colocated: NCCL refuses a group with two "
                                                   "ranks on one GPU (trainer rank and engine); use "
                                                   "weight_sync.transport=tensor (CUDA IPC, one node) or disk")
    if cfg.rl.mode != "sync":
        raise ConfigError("rl.mode", f"got {cfg.rl.mode!r}, but colocated engines must be idle while the trainer "
                                     "trains on their GPUs (they release their memory then): use rl.mode=sync, or "
                                     "placement.colocate=false")
    if cfg.rollout.partial.mode == "retract":
        raise ConfigError("rollout.partial.mode", "'retract' generates the next step's groups while the trainer "
                                                  "trains, and colocated engines must be idle then (they release "
                                                  "their memory): use 'abort' or 'off', or placement.colocate=false")
    if engine.attach:
        raise ConfigError("placement.colocate", "attached engines run outside the job, which cannot place them with "
                                                "its trainer ranks: drop rollout.engine.attach or set "
                                                "placement.colocate=false")
    if engine.tensor_parallel > 1:
        raise ConfigError("rollout.engine.tensor_parallel",
                          f"got {engine.tensor_parallel}; colocated engines are one GPU each for now (an engine over "
                          "several GPUs would hold ranks in several trainer ranks' placement bundles, which is not "
                          "built): use 1, or placement.colocate=false")
    if engine.num_engines * engine.tensor_parallel != ranks:
        raise ConfigError("rollout.engine.num_engines",
                          f"got {engine.num_engines} engine(s) of {engine.tensor_parallel} GPU(s) for "
                          f"{ranks} trainer rank(s); colocated, every GPU holds one trainer rank and one engine rank: "
                          f"set rollout.engine.num_engines={ranks // engine.tensor_parallel or 1}"
                          + ("" if ranks % engine.tensor_parallel == 0 else
                             f" and parallel.num_trainer_ranks to a multiple of {engine.tensor_parallel}"))


def _check_attach(engine, *, files: bool) -> None:
    """Attached engines: as many as num_engines, each an http URL, with the key they were started with."""
    if not engine.attach:
        return
    if len(engine.attach) != engine.num_engines:
        raise ConfigError("rollout.engine.num_engines", f"is {engine.num_engines}, but rollout.engine.attach lists "
                                                        f"{len(engine.attach)} engines: set num_engines="
                                                        f"{len(engine.attach)}")
    for url in engine.attach:
        if not (isinstance(url, str) and re.fullmatch(r"https?://[^/\s]+", url)):
            raise ConfigError("rollout.engine.attach", f"{url!r} is not an engine URL (http://HOST:PORT)")
    if not engine.attach_key_file:
        raise ConfigError("rollout.engine.attach_key_file", "is required with rollout.engine.attach: the file "
                                                            "holding the key the engines were started with")
    if files and not Path(engine.attach_key_file).is_file():
        raise ConfigError("rollout.engine.attach_key_file", f"{_shown(engine.attach_key_file)} does not exist")


def _check_ports(cfg) -> None:
    """Every port 0 (a free one, picked at the start) or in 1..65535; the ports set by hand distinct, the engines'
    range (base_port + r * num_engines + i) included."""
    ro = cfg.rollout
    single = [("rollout.router.port", ro.router.port),
              ("rollout.router.prometheus_port", ro.router.prometheus_port),
              ("weight_sync.master_port", cfg.weight_sync.master_port),
              ("rollout.engine.base_port", ro.engine.base_port)]
    for key, port in single:
        if isinstance(port, bool) or not 0 <= port <= 65535:
            raise ConfigError(key, f"got {port}; a TCP port is 1..65535 (0 = a free one, picked at the start)")
    base, count = ro.engine.base_port, ro.engine.num_engines * ro.engine.nodes_per_engine
    engine_ports = range(base, base + count) if base else range(0)
    if engine_ports and engine_ports.stop - 1 > 65535:
        raise ConfigError("rollout.engine.base_port", f"got {base}: the {count} engine ports (base_port + r * "
                                                      f"num_engines + i) would run past 65535")
    seen: dict[int, str] = {}
    for key, port in single[:3]:
        if not port:
            continue
        if port in engine_ports:
            raise ConfigError(key, f"port {port} collides with the engine ports {engine_ports.start}-"
                                   f"{engine_ports.stop - 1} (rollout.engine.base_port + i)")
        if port in seen:
            raise ConfigError(key, f"port {port} is also {seen[port]}: give each its own (or 0 for a free one)")
        seen[port] = key
