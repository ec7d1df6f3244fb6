"""The Adam the trainer's optimizers run (trainer.optimizer.adam): chosen here, built by Megatron-Core, logged.

  torch     torch.optim.AdamW (foreach kernels on the GPU; on the CPU and the emulated GPU the only one). The
            distributed optimizer keeps its step count as a tensor in every parameter's state.
  te_fused  Transformer Engine's FusedAdam (one fused multi-tensor kernel per step; the same AdamW update). Its step
            count is an int in each param group. Needs TE and a CUDA GPU.
  auto      te_fused where TE's FusedAdam imports and CUDA is up, else torch.

Without this choice Megatron-Core takes whichever imports first (TE's FusedAdam, then apex's, then torch's AdamW):
`slimish.compat.megatron_adam` says how, and makes it build exactly the one resolved here. A checkpoint loads into
either (`slimish.trainer.checkpoint`): the moments are the same tensors, and the step count moves between the
parameters' state and the param groups.
"""

from __future__ import annotations

import logging

import torch

from slimish.config.errors import ConfigError

logger = logging.getLogger(__name__)

ADAMS = ("auto", "torch", "te_fused")
NAMES = {"torch": "torch.optim.AdamW", "te_fused": "Transformer Engine's FusedAdam"}


def te_fused_adam() -> type | None:
    """Transformer Engine's FusedAdam class where it imports and CUDA is up (its kernels run on NVIDIA GPUs only),
    else None."""
    if not torch.cuda.is_available():
        return None
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
    except ImportError:
        return None
    return FusedAdam


def resolve(adam: str) -> tuple[str, type | None]:
    """(the Adam that runs for trainer.optimizer.adam `adam`: "torch" or "te_fused", TE's FusedAdam class for
    te_fused). Raises ConfigError naming the fix where te_fused cannot run."""
    if adam not in ADAMS:
        raise ConfigError("trainer.optimizer.adam", f"got {adam!r}; one of {', '.join(ADAMS)}")
    if adam == "torch":
        return "torch", None
    fused = te_fused_adam()
    if fused is not None:
        return "te_fused", fused
    if adam == "auto":
        return "torch", None
    raise ConfigError("trainer.optimizer.adam", "te_fused needs Transformer Engine's FusedAdam and a CUDA GPU (import "
                                                "transformer_engine.pytorch.optimizers failed or no GPU is visible): "
                                                "install the GPU stack (make venv-gpu), or set "
                                                "trainer.optimizer.adam=torch (or auto)")


def install(adam: str) -> str:
    """Resolve trainer.optimizer.adam `adam`, make Megatron-Core build that Adam from now on in this process, and log
    which one at INFO (once per process, and again if it changes). Returns "torch" or "te_fused"."""
    from slimish.compat import megatron_adam

    choice, fused = resolve(adam)
    before, megatron_default = megatron_adam.chosen(), megatron_adam.megatron_builds()
    megatron_adam.use(choice, fused_adam=fused)
    if before != choice:
        why = "" if adam != "auto" else (" (auto: Transformer Engine's FusedAdam imports and CUDA is up)"
                                         if choice == "te_fused" else " (auto: no Transformer Engine FusedAdam with "
                                                                      "CUDA here)")
        unlike = "" if megatron_default == choice or before is not None else \
            f"; Megatron-Core alone would have built {megatron_default}"
        logger.info("trainer Adam: %s, trainer.optimizer.adam=%s%s%s", NAMES[choice], adam, why, unlike)
    return choice
