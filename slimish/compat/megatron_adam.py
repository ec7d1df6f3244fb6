"""Which Adam Megatron-Core 0.16.1 builds: the one slimish names (trainer.optimizer.adam), not the first that imports.

Why a patch: Megatron-Core makes the choice at import time, in module globals, and takes no argument for it.
`megatron.core.optimizer` binds `Adam` to Transformer Engine's FusedAdam when TE imports, else to apex's FusedAdam,
else to torch's AdamW (and sets `USING_PYTORCH_OPTIMIZER`); `get_megatron_optimizer` builds whatever `Adam` is
(torch's AdamW or Adam by `decoupled_weight_decay` when `USING_PYTORCH_OPTIMIZER`), and its CPU-offloading optimizer
takes `Adam` for the share that stays on the GPU. `megatron.core.optimizer.distrib_optimizer` makes the same choice
again in globals of its own (`Adam`, `HAVE_APEX_OR_TE`, `USING_TE_OPTIMIZER`, `USING_APEX_OPTIMIZER`) and reads them
whenever the distributed optimizer is built, saved or loaded: they say where Adam's step count lives (torch's Adam:
a tensor in every parameter's state; the fused ones: an int in each param group). Installing TE (or apex: NGC
containers ship it) therefore swaps the optimizer silently, and the layout of its checkpoints with it.

`use(choice)` sets every one of those globals, for the whole process: the flags must stay as they were when the
optimizer was built for as long as it saves and loads, and a trainer process builds one kind (every role takes
trainer.optimizer). `slimish.trainer.adam` decides the choice and logs it.
"""

from __future__ import annotations

import torch

CHOICES = ("torch", "te_fused")
_CHOSEN: str | None = None


def use(choice: str, *, fused_adam: type | None = None) -> type:
    """Make Megatron-Core build `choice`: "torch" (torch.optim.AdamW; the distributed optimizer keeps torch's
    per-parameter step) or "te_fused" (`fused_adam`, Transformer Engine's FusedAdam class: the caller imports it, so
    that this module never imports TE; its step lives in the param groups). Returns the class Megatron builds."""
    global _CHOSEN
    import megatron.core.optimizer as optimizer
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    if choice == "torch":
        # As Megatron binds them when neither TE nor apex imports.
        built, distrib_adam, fused = torch.optim.AdamW, torch.optim.Adam, False
    elif choice == "te_fused":
        if fused_adam is None:
            raise ValueError("use('te_fused') needs Transformer Engine's FusedAdam class (fused_adam=)")
        built, distrib_adam, fused = fused_adam, fused_adam, True
    else:
        raise ValueError(f"Adam {choice!r}: one of {', '.join(CHOICES)}")
    optimizer.Adam, optimizer.USING_PYTORCH_OPTIMIZER = built, not fused
    distrib_optimizer.Adam = distrib_adam
    distrib_optimizer.HAVE_APEX_OR_TE = distrib_optimizer.USING_TE_OPTIMIZER = fused
    distrib_optimizer.USING_APEX_OPTIMIZER = False
    _CHOSEN = choice
    return built


def chosen() -> str | None:
    """The Adam `use` last made Megatron build in this process (None: Megatron's own import-time choice)."""
    return _CHOSEN


def megatron_builds() -> str:
    """What Megatron-Core's globals build now: "torch", "te_fused" or "apex_fused" (its own choice, before `use`)."""
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    if not distrib_optimizer.HAVE_APEX_OR_TE:
        return "torch"
    return "te_fused" if distrib_optimizer.USING_TE_OPTIMIZER else "apex_fused"
