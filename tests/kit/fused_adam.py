"""A stand-in for Transformer Engine's FusedAdam, where TE is absent (the CPU tiers): its state layout, not its kernel.

What it keeps as TE's FusedAdam (transformer_engine/pytorch/optimizers/fused_adam.py) does, which is what
Megatron-Core and `slimish.trainer.checkpoint` must handle for trainer.optimizer.adam=te_fused:
- the step count is an int in each param group (`group["step"]`, 1 after the first step), shared by the group's
  parameters; no parameter's state holds one;
- a parameter's state is "exp_avg" and "exp_avg_sq" (fp32), made at its first step when empty;
- its kernel takes the step as an int: a float one (what torch's Adam leaves in a checkpoint) raises TypeError, as
  the pybind11 binding of `multi_tensor_adam` does;
- `state_dict` / `load_state_dict` handle every state entry by its name, and know exp_avg, exp_avg_sq and
  master_param only (TE unscales and rescales each: any other name is a KeyError there);
- its constructor takes TE's keywords (adam_w_mode, bias_correction, ...).
Its update is the one torch's single-tensor AdamW makes, operation for operation, so that a run with it gives torch's
numbers bit for bit and a test can tell a state-layout error from rounding.

`use_stand_in()` makes the trainer see it as TE's FusedAdam (`slimish.trainer.adam.te_fused_adam`, the one
boundary), so that trainer.optimizer.adam=te_fused builds it.
"""

from __future__ import annotations

import math

import torch

STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")


class StandInFusedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, *, bias_correction: bool = True, adam_w_mode: bool = True, **_te_keywords):
        if amsgrad or not adam_w_mode or not bias_correction:
            raise NotImplementedError("the stand-in makes AdamW's update with bias correction only")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            step = group["step"]
            if not isinstance(step, int):
                raise TypeError(f"multi_tensor_adam(): incompatible function arguments (step {step!r} is not an int)")
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                state = self.state[param]
                if not state:
                    state.update(exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
                if param.grad is None:
                    continue
                grad, exp_avg, exp_avg_sq = param.grad, state["exp_avg"], state["exp_avg_sq"]
                if decay:
                    param.mul_(1 - lr * decay)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))
        return loss

    def state_dict(self):
        state_dict = super().state_dict()
        for state in state_dict["state"].values():
            for name in state:
                _known(name)
        return state_dict

    def load_state_dict(self, state_dict):
        for state in state_dict["state"].values():
            for name in state:
                _known(name)
        super().load_state_dict(state_dict)


def _known(name: str) -> None:
    if name not in STATE_NAMES:
        raise KeyError(name)  # TE: self.name_to_dtype_map[state_name]


def keep_megatron_adam(monkeypatch) -> None:
    """Have pytest's `monkeypatch` put back, after the test, the Adam Megatron-Core builds in this process (tests that
    build another one share the process with tests that expect torch's)."""
    import megatron.core.optimizer as optimizer
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    from slimish.compat import megatron_adam

    for module, names in ((optimizer, ("Adam", "USING_PYTORCH_OPTIMIZER")),
                          (distrib_optimizer, ("Adam", "HAVE_APEX_OR_TE", "USING_TE_OPTIMIZER",
                                               "USING_APEX_OPTIMIZER")),
                          (megatron_adam, ("_CHOSEN",))):
        for name in names:
            monkeypatch.setattr(module, name, getattr(module, name))


def use_stand_in(monkeypatch=None) -> None:
    """Make `slimish.trainer.adam.te_fused_adam` return the stand-in (through pytest's `monkeypatch` when given)."""
    from slimish.trainer import adam

    if monkeypatch is not None:
        monkeypatch.setattr(adam, "te_fused_adam", lambda: StandInFusedAdam)
    else:
        adam.te_fused_adam = lambda: StandInFusedAdam
