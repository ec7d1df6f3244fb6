"""Build the Megatron-Core GPTModel for an HF architecture, wrap it in Megatron DDP, and build its optimizer."""

from __future__ import annotations

import logging

import torch

from slimish.config.errors import ConfigError
from slimish.megatron_bridge.hf_config import Architecture, gpt_model_kwargs, transformer_config
from slimish.trainer.device import trainer_device

logger = logging.getLogger(__name__)


def build_gpt_model(arch: Architecture, *, tensor_parallel: int, pipeline_parallel: int, expert_parallel: int = 1,
                    expert_tensor_parallel: int = 0, dtype: torch.dtype = torch.float32, recompute: str = "none",
                    recompute_modules: tuple[str, ...] = ("core_attn",), attention: str = "auto",
                    sequence_parallel: bool = False, context_parallel: int = 1, cp_comm_type: str = "p2p",
                    first_stage_layers: int = 0, last_stage_layers: int = 0, virtual_pipeline: int = 1,
                    vp_stage: int | None = None):
    """An unwrapped GPTModel for this pipeline stage (with `virtual_pipeline` > 1: its model chunk `vp_stage`); a
    mixture-of-experts model gets sparse or dense MLPs per layer as config.json says. `attention`
    (trainer.attention, `slimish.trainer.attention.resolve`): `te` builds Megatron's Transformer-Engine layer spec,
    `sdpa` and `local` its local spec with that core attention.
    recompute="full" recomputes every transformer layer in the backward pass (Megatron's uniform method, one layer
    per checkpoint); recompute="selective" recomputes only `recompute_modules` of every layer (Megatron's selective
    granularity: "core_attn" checkpoints the core attention, whichever runs: `SdpaAttention`, Megatron's local
    `DotProductAttention` or TE's). `sequence_parallel` (parallel.sequence_parallel, at tensor_parallel > 1):
    Megatron's sequence parallelism; the sequences fed to the model must then be a multiple of tensor_parallel
    tokens long.
    `context_parallel` (parallel.context_parallel): each rank gets its load-balanced share of every sequence
    (`slimish.trainer.context_parallel`); `cp_comm_type` is Transformer Engine's exchange of keys and values.
    `first_stage_layers` / `last_stage_layers` (0: an even share): uneven pipeline stages
    (`slimish.megatron_bridge.hf_config.pipeline_stage_layers`). `virtual_pipeline` (parallel.virtual_pipeline):
    Megatron's interleaved schedule, this rank's layers in that many chunks, each built by a call of its own.
    `expert_tensor_parallel` (0: tensor_parallel) splits each expert; it must be the size Megatron's parallel state
    was set up with."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from slimish.compat import megatron_te_absent
    from slimish.trainer import attention as attentions

    attention = attentions.resolve(attention)
    megatron_te_absent.apply()  # MoE layers without Transformer Engine, on the GPU as on the CPU
    device = trainer_device()
    # Megatron creates the parameters on the device it finds current, unless told to build them on the CPU.
    config = transformer_config(arch, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                                expert_parallel=expert_parallel, expert_tensor_parallel=expert_tensor_parallel,
                                params_dtype=dtype, use_cpu_initialization=device.type == "cpu",
                                sequence_parallel=sequence_parallel, context_parallel=context_parallel,
                                cp_comm_type=cp_comm_type, first_stage_layers=first_stage_layers,
                                last_stage_layers=last_stage_layers, virtual_pipeline=virtual_pipeline,
                                **recompute_fields(recompute, recompute_modules))
    if attention == "te":  # TE's norms fused into the next linear: the bridge maps those names (dense.TE_ALIASES)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm",
                                          vp_stage=vp_stage)
    else:
        spec = _local_spec(config, attention, vp_stage)
    model = GPTModel(config=config, transformer_layer_spec=spec, vp_stage=vp_stage,
                     pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                     post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                     **gpt_model_kwargs(arch))
    # torch's RMSNorm (WrappedTorchNorm) ignores config.params_dtype and makes fp32 weights. Every parameter takes the
    # model's dtype, as Megatron's Float16Module would give it: SGLang's norms hold the same dtype, and Megatron's
    # mixed-precision optimizer checkpoints only parameters of the model's dtype (an fp32 norm beside bf16 layers
    # failed every save: "Param id N does not match any model sharded param").
    for param in model.parameters():
        if param.dtype != config.params_dtype and param.is_floating_point():
            param.data = param.data.to(config.params_dtype)
    _mark_expert_data_parallel(model, config)
    # Megatron builds its parameters on the device; what it keeps elsewhere (buffers) follows. On the CPU nothing
    # moves (a model built on the meta device, to read its shapes, stays there).
    return model.to(device) if device.type != "cpu" else model


def _mark_expert_data_parallel(model, config) -> None:
    """Megatron's DDP and optimizer reduce a parameter's gradient over the experts' data-parallel group (EDP: world /
    (ETP x EP x PP)), and give it an optimizer of its own (a second part of a chained optimizer), only when it is
    flagged `allreduce = False`; Megatron-Core 0.16 flags the experts' weights so only at expert_parallel > 1. At EP1
    with an expert tensor parallelism other than TP, EDP is not the data-parallel group (TP2 with each expert whole:
    DP1, EDP2): the experts' gradients, each from the tokens of one rank, would not be summed over EDP and its ranks'
    experts would drift apart. Flagged at every layout (at EP1 and ETP = TP, EDP's ranks are DP's: the same sums),
    the optimizer has the same parts at every layout, so a checkpoint's optimizer state loads at any of them."""
    if not config.num_moe_experts:
        return
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def recompute_fields(recompute: str, modules: tuple[str, ...] | list[str] = ("core_attn",)) -> dict:
    """Megatron TransformerConfig fields for trainer.recompute `recompute` (and trainer.recompute_modules `modules`,
    read at "selective"), set when the config is made so that Megatron checks them."""
    if recompute == "none":
        return {}
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute == "selective":
        if not modules:
            raise ValueError("recompute='selective' needs at least one module to recompute")
        return dict(recompute_granularity="selective", recompute_modules=list(dict.fromkeys(modules)))
    raise ValueError(f"recompute={recompute!r}: none, full or selective")


def _local_spec(config, attention: str, vp_stage: int | None = None):
    """Megatron's local (non-Transformer-Engine) decoder block spec with `attention` (sdpa or local) as every
    layer's core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from slimish.trainer import attention as attentions

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage)
    # The block's final norm is the spec module's LNImpl: apex's FusedLayerNorm whenever `import apex` succeeds (NGC
    # containers ship apex), and FusedLayerNorm refuses RMSNorm. Every norm, the final one too, is `RMSNorm`.
    spec = _with_norm(spec, RMSNorm)
    spec.layer_norm = RMSNorm
    if config.multi_latent_attention:
        from slimish.compat.megatron_mla import local_mla_block_spec

        spec = local_mla_block_spec(spec)
    return attentions.block_spec(spec, attention, context_parallel=config.context_parallel_size)


class RMSNorm:
    """torch's RMSNorm for the local spec, in place of Megatron's `WrappedTorchNorm`, which refuses sequence
    parallelism (a class building another, as that one is: Megatron's `build_module` would return a function
    unbuilt). Under sequence parallelism a norm sees 1/tp of the sequence, so its weight's gradient is partial on
    each tensor-parallel rank: `sequence_parallel` on the weight has Megatron's `finalize_model_grads` all-reduce it
    over the tensor-parallel group, as it does for Transformer Engine's norms. (The attention's q / k norms, after the
    sequence is gathered, are all-reduced by Megatron for qk_layernorm either way: the flag changes nothing there.)"""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"normalization {config.normalization!r}: the trainer builds RMSNorm models only")
        # Made where Megatron makes its parameters, in the model's dtype: moved later, a parameter may come back as
        # a new object without the flag (it does on the emulated GPU).
        device = torch.device("cpu") if config.use_cpu_initialization else trainer_device()
        norm = torch.nn.RMSNorm(hidden_size, eps=eps, device=device, dtype=config.params_dtype)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


def _with_norm(spec, norm):
    """A copy of a block spec with every `WrappedTorchNorm` in it replaced by `norm`."""
    import copy
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def replace(node, seen):
        if node is WrappedTorchNorm:
            return norm
        if id(node) in seen or not (isinstance(node, (ModuleSpec, list, tuple)) or dataclasses.is_dataclass(node)):
            return node
        seen.add(id(node))
        if isinstance(node, (list, tuple)):
            return type(node)(replace(item, seen) for item in node)
        for field in (f.name for f in dataclasses.fields(node)) if dataclasses.is_dataclass(node) else ():
            setattr(node, field, replace(getattr(node, field), seen))
        return node

    return replace(copy.deepcopy(spec), set())


def wrap_for_training(chunks: list, opt_cfg, *, lr: float, total_steps: int):
    """(each of the rank's model `chunks` wrapped in Megatron's DDP, one Megatron Adam optimizer over them all with
    fp32 main params, its learning-rate schedule) for
    trainer.optimizer `opt_cfg` peaking at `lr` (`slimish.trainer.lr_schedule`; `total_steps`: the run's optimizer
    steps). trainer.optimizer.distributed shards the main params, grads and moments over the data-parallel ranks
    (Megatron's distributed optimizer); trainer.optimizer.adam is the Adam it runs (`slimish.trainer.adam`), and
    trainer.optimizer.cpu_offload puts a share of its state in host memory (`cpu_offload_fields`)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from slimish.trainer import adam
    from slimish.trainer.lr_schedule import build_lr_schedule

    offload = cpu_offload_fields(opt_cfg)
    adam.install(opt_cfg.adam)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=opt_cfg.distributed)
    models = [DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk) for chunk in chunks]
    for chunk in chunks:
        # Without this, data-parallel replicas never all-reduce their grads and silently diverge.
        chunk.config.finalize_model_grads_func = finalize_model_grads
    config = chunks[0].config
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=lr * opt_cfg.min_lr_ratio, weight_decay=opt_cfg.weight_decay,
        adam_beta1=opt_cfg.adam_beta1, adam_beta2=opt_cfg.adam_beta2, adam_eps=opt_cfg.adam_eps,
        clip_grad=opt_cfg.clip_grad, bf16=config.bf16, params_dtype=config.params_dtype,
        use_distributed_optimizer=opt_cfg.distributed, **offload), models)
    return models, optimizer, build_lr_schedule(optimizer, opt_cfg, lr=lr, total_steps=total_steps)


def cpu_offload_fields(opt_cfg) -> dict:
    """Megatron OptimizerConfig fields for trainer.optimizer.cpu_offload (none when off). Megatron-Core 0.16's
    CPU-offloading optimizer (`HybridDeviceOptimizer`) runs inside the distributed optimizer, on the precision-aware
    path (as Megatron-LM requires: without it the offloaded state fails to load back from a checkpoint): the
    distributed optimizer hands it the bf16 parameter shards and their fp32 gradients, and it keeps the fp32 main
    weights itself, next to the moments, for each parameter where it updates it (the first `cpu_offload` share of
    them, in host memory, by torch's AdamW; the rest on the GPU, by trainer.optimizer.adam). The config checks
    refuse what it cannot run (`slimish.config.validate._check_cpu_offload`); that it needs a GPU is checked here,
    where the trainer's device is known: on the CPU the state is in host memory already, and Megatron's optimizer,
    which offloads what `is_cuda`, would find nothing to move and fail its first step."""
    from slimish.config.validate import offload_fraction

    fraction = offload_fraction(opt_cfg.cpu_offload)
    if not fraction:
        return {}
    if trainer_device().type == "cpu":
        raise ConfigError("trainer.optimizer.cpu_offload", "moves the optimizer's state from the GPU to host memory, "
                                                           "and this trainer runs on the CPU, where the state is "
                                                           "already: set trainer.optimizer.cpu_offload=false")
    logger.info("trainer optimizer: %d%% of its fp32 main weights and Adam moments in host memory, updated there by "
                "torch's AdamW (trainer.optimizer.cpu_offload=%s)", round(100 * fraction), opt_cfg.cpu_offload)
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction, use_precision_aware_optimizer=True,
                store_param_remainders=False, overlap_cpu_optimizer_d2h_h2d=opt_cfg.cpu_offload_overlap)
