"""Megatron-Core 0.16 without Transformer Engine, on every device.

`megatron.core.transformer.moe.moe_utils` imports its fused MoE helpers from Transformer Engine inside a
try block and, when TE is absent, leaves the names undefined; its router and permutation code then refer to them
unguarded (`if fused_topk_with_score_function is None`, `te_general_gemm is not None`), which raises NameError on the
first MoE forward. Defining each absent name as None is what the module's own guards expect: the unfused paths run.
`megatron.core.tensor_parallel.random.CheckpointWithoutOutput` (selective recompute of the norms, of MLA's up
projections) sets `self.fp8 = fp8 is not None`, so its default `fp8=False` reads as fp8 on, and its forward then
calls Transformer Engine's `FP8GlobalStateManager`, which TE's absence leaves undefined: NameError on the first
recomputed norm. Without TE there is no fp8 at all: the flag is made what the caller asked (`fp8` None or False:
off).
`megatron.core.optimizer.optimizer_config.OptimizerConfig` (with use_precision_aware_optimizer, which Megatron's
optimizer CPU offload runs on: trainer.optimizer.cpu_offload) compares `get_te_version()` with "2.1.0", and without
TE that version is None: TypeError when the config is made. No TE is no TE version at least anything: that module's
`is_te_min_version` answers False (it then turns TE's store_param_remainders off, which slimish does anyway).
This is not about the CPU: a GPU without TE (the lent test machine, a node before the GPU lock is installed) hits it
as well, so it is applied wherever a model is built, not by `megatron_cpu.apply()` alone (which does nothing on a
machine with CUDA).
"""

from __future__ import annotations

# The names moe_utils takes from Transformer Engine when it can (megatron-core 0.16.1).
MOE_UTILS_TE_NAMES = ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss",
                      "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                      "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function", "fused_unpermute")


def apply() -> list[str]:
    """Define every TE name moe_utils lacks as None, and read CheckpointWithoutOutput's fp8 flag as given when TE is
    absent. Idempotent; returns the names it defined (none with TE)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    defined = [name for name in MOE_UTILS_TE_NAMES if not hasattr(moe_utils, name)]
    for name in defined:
        setattr(moe_utils, name, None)
    _checkpoint_without_output_fp8_as_given()
    _optimizer_config_without_te()
    return defined


def _optimizer_config_without_te() -> bool:
    """Without TE, OptimizerConfig's TE version checks answer False (see the module docstring). True if patched (TE
    absent); idempotent."""
    import megatron.core.optimizer.optimizer_config as optimizer_config
    from megatron.core.utils import get_te_version

    if get_te_version() is not None:
        return False
    optimizer_config.is_te_min_version = lambda version, check_equality=True: False
    return True


def _checkpoint_without_output_fp8_as_given() -> bool:
    """Without TE, CheckpointWithoutOutput(fp8=False) (or None) is not fp8 (see the module docstring). True if
    patched (TE absent); idempotent."""
    import megatron.core.tensor_parallel.random as tp_random

    if tp_random.HAVE_TE:
        return False
    cls = tp_random.CheckpointWithoutOutput
    if getattr(cls.__init__, "_slimish_fp8_as_given", False):
        return True
    original = cls.__init__

    def __init__(self, fp8=False):
        original(self, fp8)
        self.fp8 = fp8 not in (None, False)

    __init__._slimish_fp8_as_given = True
    cls.__init__ = __init__
    return True
