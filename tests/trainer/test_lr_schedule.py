"""trainer.optimizer's learning-rate schedule (Megatron-Core's OptimizerParamScheduler, `slimish.trainer.lr_schedule`)
by hand: optimizer step k trains at the schedule's value at k."""

from __future__ import annotations

import pytest

from slimish.config.schema import OptimizerConfig
from slimish.trainer.lr_schedule import build_lr_schedule, current_lr, load_position


class Groups:  # what the scheduler touches of a MegatronOptimizer (whose groups carry their max_lr and min_lr)
    def __init__(self, lr: float = 1.0):
        self.param_groups = [{"default_config": True, "max_lr": lr, "min_lr": 0.1 * lr, "wd_mult": 1.0},
                             {"default_config": True, "max_lr": lr, "min_lr": 0.1 * lr, "wd_mult": 0.0}]


def _lrs(steps: int, **settings) -> list[float]:
    optimizer = Groups()
    schedule = build_lr_schedule(optimizer, OptimizerConfig(lr=1.0, min_lr_ratio=0.1, weight_decay=0.5, **settings),
                                 lr=1.0, total_steps=6)
    out = []
    for _ in range(steps):
        schedule.step(1)
        out.append(current_lr(optimizer))
    return out


def test_warm_up_then_constant_linear_or_cosine():
    assert _lrs(4) == [1.0] * 4
    assert _lrs(4, lr_warmup_steps=2) == pytest.approx([0.5, 1.0, 1.0, 1.0])
    # decay over steps 2..6 (the run's last): ratio (k - 2) / 4
    assert _lrs(7, lr_warmup_steps=2, lr_decay_style="linear") == pytest.approx(
        [0.5, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1])
    assert _lrs(4, lr_warmup_steps=2, lr_decay_style="cosine")[3] == pytest.approx(0.55)  # half-way: the mean
    assert _lrs(4, lr_decay_style="linear", lr_decay_steps=3) == pytest.approx([0.7, 0.4, 0.1, 0.1])


def test_weight_decay_spares_the_groups_megatron_marks():
    """Megatron gives biases and norms wd_mult 0; the scheduler is what applies it."""
    optimizer = Groups()
    build_lr_schedule(optimizer, OptimizerConfig(lr=1.0, weight_decay=0.5), lr=1.0, total_steps=6)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.5, 0.0]


def test_a_loaded_position_continues_with_the_configs_shape():
    optimizer = Groups()
    old = build_lr_schedule(optimizer, OptimizerConfig(lr=1.0, lr_warmup_steps=4), lr=1.0, total_steps=6)
    old.step(3)
    state = old.state_dict()
    new = build_lr_schedule(Groups(2.0), OptimizerConfig(lr=2.0, lr_warmup_steps=4), lr=2.0, total_steps=6)
    new.step(1)  # already used: loading replaces the position, it does not add to it
    load_position(new, state)
    assert new.num_steps == 3 and current_lr(new.optimizer) == pytest.approx(1.5)  # 2.0 x 3 / 4: the new peak
