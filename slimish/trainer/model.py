"""Build the Megatron-Core GPTModel for an HF architecture, wrap it in Megatron DDP, and build its optimizer."""

from __future__ import annotations

import torch

from slimish.megatron_bridge.hf_config import Architecture, gpt_model_kwargs, transformer_config


def build_gpt_model(arch: Architecture, *, tensor_parallel: int, pipeline_parallel: int, expert_parallel: int = 1,
                    dtype: torch.dtype = torch.float32, recompute: str = "none"):
    """An unwrapped GPTModel for this pipeline stage, using the local (non-Transformer-Engine) layer specs; a
    mixture-of-experts model gets sparse or dense MLPs per layer as config.json says. recompute="full" recomputes
    every transformer layer in the backward pass (Megatron's uniform method, one layer per checkpoint)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from slimish.compat.packed_attention import local_packed_block_spec

    config = transformer_config(arch, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                                expert_parallel=expert_parallel, params_dtype=dtype,
                                use_cpu_initialization=not torch.cuda.is_available())
    if recompute == "full":
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if config.multi_latent_attention:
        from slimish.compat.megatron_mla import local_mla_block_spec

        spec = local_mla_block_spec(spec)
    spec = local_packed_block_spec(spec)  # packed micro-batches (trainer.max_tokens_per_micro_batch) on CPU too
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), **gpt_model_kwargs(arch))
    if torch.cuda.is_available():
        model.cuda()
    return model


def wrap_for_training(model, *, lr: float, weight_decay: float, adam_beta1: float, adam_beta2: float,
                      adam_eps: float, clip_grad: float, distributed: bool = False):
    """(DDP-wrapped model, Megatron Adam optimizer with fp32 main params); `distributed` shards the main params,
    grads and moments over the data-parallel ranks (Megatron's distributed optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = model.config
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed), module=model)
    # Without this, data-parallel replicas never all-reduce their grads and silently diverge.
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=adam_beta1, adam_beta2=adam_beta2,
        adam_eps=adam_eps, clip_grad=clip_grad, bf16=config.bf16, params_dtype=config.params_dtype,
        use_distributed_optimizer=distributed), [ddp])
    return ddp, optimizer
