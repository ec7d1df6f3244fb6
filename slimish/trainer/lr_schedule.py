"""The learning-rate schedule of an RL optimizer: Megatron-Core's own `OptimizerParamScheduler` (linear warm-up, then
constant, linear or cosine decay to a minimum), counted in optimizer steps (`trainer.num_minibatches` per RL step).

Optimizer step k (1-based) trains at the schedule's value at k: with `lr_warmup_steps` W the first step already
trains at lr / W (Megatron's own loop steps the scheduler after the optimizer, so its first step trains at the warm-up's
initial 0) and step W at the peak; decay then reaches `lr x min_lr_ratio` at step `lr_decay_steps`. Only the
position (`num_steps`) comes from a checkpoint: the shape is the config's, so a resumed run keeps its place in the
schedule and a changed config takes effect. The scheduler also applies Megatron's per-group weight-decay multiplier
(0 for biases and norms)."""

from __future__ import annotations


def build_lr_schedule(optimizer, opt_cfg, *, lr: float, total_steps: int):
    """A scheduler for `optimizer` (a MegatronOptimizer) peaking at `lr`; `opt_cfg` is trainer.optimizer;
    `total_steps` (the run's optimizer steps) is where the decay ends when trainer.optimizer.lr_decay_steps is 0."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = opt_cfg.lr_decay_steps or total_steps
    if opt_cfg.lr_decay_style == "constant":
        decay_steps = max(decay_steps, opt_cfg.lr_warmup_steps + 1)  # unused, but Megatron wants warm-up < decay
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=lr * opt_cfg.min_lr_ratio, lr_warmup_steps=opt_cfg.lr_warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=opt_cfg.lr_decay_style, start_wd=opt_cfg.weight_decay,
        end_wd=opt_cfg.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)


def rl_optimizer_steps(cfg) -> int:
    """The run's optimizer steps: rl.num_steps x trainer.num_minibatches (the SFT warm-up's are apart)."""
    return cfg.rl.num_steps * cfg.trainer.num_minibatches


def current_lr(optimizer) -> float:
    """The learning rate the optimizer's next step uses (its default parameter groups')."""
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    return float(get_canonical_lr_for_logging(optimizer.param_groups))


def load_position(scheduler, state: dict) -> None:
    """Continue `scheduler` from a checkpoint's `state_dict()`: its step count, this config's shape."""
    scheduler.num_steps = 0  # Megatron's load adds the checkpoint's count to the current one
    scheduler.load_state_dict(state)
