"""Trainer checkpoints: a worker loaded from a checkpoint holds bit-identical weights and optimizer state, so its
next step equals the uninterrupted worker's; a checkpoint saved at one layout loads at another (TP1 <-> TP2,
TP1 -> PP2, DP2 -> TP1; a mixture-of-experts model's at expert tensor parallelism 1 x TP2 -> TP1, -> EP2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slimish.megatron_bridge.errors import CheckpointError
from tests.kit.trainer import export_state, make_worker, rl_step, task_overrides
from tests.multiproc import run_world
from tests.trainer.worker_rank import fixed_samples

SCRIPT = Path(__file__).with_name("checkpoint_rank.py")
ADVANTAGES = [1.0, -1.0, -1.0, 1.0, 0.5, -0.5, 0.5, -0.5]


def _worker(task_assets, overrides=()):
    return make_worker(*task_overrides(task_assets), "trainer.micro_batch_size=2", "trainer.optimizer.lr=0.01",
                       "trainer.loss.kl_coef=0.1", *overrides)


def _step(worker) -> dict:
    return rl_step(worker, fixed_samples(), ADVANTAGES)


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loaded_worker_continues_exactly_like_the_uninterrupted_one(task_assets, megatron_world, tmp_path, dtype):
    """In bf16 too: Megatron's mixed-precision optimizer (fp32 main params) saves and loads every parameter."""
    first = _worker(task_assets, [f"model.dtype={dtype}"])
    _step(first)
    _step(first)  # two steps: Adam's moments and step count are non-trivial
    first.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = _worker(task_assets, [f"model.dtype={dtype}"])
    assert not torch.equal(export_state(first)["lm_head.weight"], export_state(resumed)["lm_head.weight"])
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    _assert_equal(export_state(first), export_state(resumed))
    assert _step(first) == _step(resumed)
    _assert_equal(export_state(first), export_state(resumed))


def test_resumed_mid_warm_up_each_step_trains_at_the_uninterrupted_runs_lr(task_assets, megatron_world, tmp_path):
    """Warm-up over 3 optimizer steps, then linear decay to 0.1 x lr at the run's 5th: a run stopped after step 2 and
    resumed from its checkpoint trains steps 3-5 at exactly the uninterrupted run's lr."""
    schedule = ["rl.num_steps=5", "trainer.num_minibatches=1", "trainer.optimizer.lr_warmup_steps=3",
                "trainer.optimizer.lr_decay_style=linear", "trainer.optimizer.min_lr_ratio=0.1"]
    uninterrupted = _worker(task_assets, schedule)
    expected = [_step(uninterrupted)["lr"] for _ in range(5)]
    assert expected == pytest.approx([0.01 / 3, 0.02 / 3, 0.01, 0.0055, 0.001])
    first = _worker(task_assets, schedule)
    got = [_step(first)["lr"] for _ in range(2)]
    first.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = _worker(task_assets, schedule)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    got += [_step(resumed)["lr"] for _ in range(3)]
    assert got == expected


def test_load_of_a_missing_checkpoint_names_the_path(task_assets, megatron_world, tmp_path):
    worker = _worker(task_assets)
    with pytest.raises(CheckpointError, match="nothing-here"):
        worker.load_checkpoint(str(tmp_path / "nothing-here"))


def _world(task_assets, out: Path, layout: tuple[int, int, int], *, mode: str, ckpt: Path,
           overrides: tuple[str, ...] = ()) -> dict:
    world, tp, pp = layout
    run_world(SCRIPT, world_size=world, args=["--tp", str(tp), "--pp", str(pp), "--hf", task_assets["model"],
                                              "--data", task_assets["train"], "--mode", mode, "--ckpt", str(ckpt),
                                              "--out", str(out), *(a for o in overrides for a in ("--set", o))])
    return torch.load(out / "rank0.pt")


LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 2, 1), "pp2": (2, 1, 2), "dp2": (2, 1, 1)}  # (ranks, TP, PP)


@pytest.mark.parametrize("save,load", [("tp1", "tp2"), ("tp2", "tp1"), ("tp1", "pp2"), ("dp2", "tp1")],
                         ids=["tp1-to-tp2", "tp2-to-tp1", "tp1-to-pp2", "dp2-to-tp1"])
def test_checkpoint_loads_at_another_layout(task_assets, tmp_path, save, load):
    saved = _world(task_assets, tmp_path / "save", LAYOUTS[save], mode="save", ckpt=tmp_path / "ckpt")
    loaded = _world(task_assets, tmp_path / "load", LAYOUTS[load], mode="load", ckpt=tmp_path / "ckpt")
    _assert_equal(saved["at_save"], loaded["at_load"])  # resharding moves numbers, never changes them
    assert loaded["metrics"]["ppo_kl"] == 0.0
    assert loaded["metrics"]["pg_loss"] == pytest.approx(saved["metrics"]["pg_loss"], abs=1e-5)
    for name, tensor in saved["after"].items():
        # Same optimizer state; only the reduction order differs (as in test_worker_layouts).
        diff = (tensor - loaded["after"][name]).abs()
        assert diff.max() <= 1e-3 and diff.mean() <= 1e-6, name


DISTRIBUTED = ("trainer.optimizer.distributed=true",)


def test_distributed_optimizer_resumes_exactly_and_at_another_layout(task_assets, tmp_path):
    """Megatron's distributed optimizer (Adam state sharded over DP2): resuming at DP2 continues bit-exactly like
    the uninterrupted run; the same checkpoint loads at TP2 (reduction order only); a plain optimizer refuses it
    naming the key to set."""
    ckpt = tmp_path / "ckpt"
    saved = _world(task_assets, tmp_path / "save", LAYOUTS["dp2"], mode="save", ckpt=ckpt, overrides=DISTRIBUTED)
    same = _world(task_assets, tmp_path / "dp2", LAYOUTS["dp2"], mode="load", ckpt=ckpt, overrides=DISTRIBUTED)
    _assert_equal(saved["at_save"], same["at_load"])
    _assert_equal(saved["after"], same["after"])  # the Adam moments and step came back exactly
    other = _world(task_assets, tmp_path / "tp2", LAYOUTS["tp2"], mode="load", ckpt=ckpt, overrides=DISTRIBUTED)
    _assert_equal(saved["at_save"], other["at_load"])
    for name, tensor in saved["after"].items():
        diff = (tensor - other["after"][name]).abs()
        assert diff.max() <= 1e-3 and diff.mean() <= 1e-6, name
    with pytest.raises(AssertionError, match="trainer.optimizer.distributed=true"):
        _world(task_assets, tmp_path / "plain", LAYOUTS["tp1"], mode="load", ckpt=ckpt)


def test_a_checkpoint_in_megatrons_fully_reshardable_format_still_resumes_exactly(task_assets, tmp_path):
    """Checkpoints of the distributed optimizer written before each rank saved its own shard (Megatron's
    fully_reshardable format: the same keys, whole tensors) load into the sharded format's reader, bit-exactly."""
    ckpt = tmp_path / "ckpt"
    saved = _world(task_assets, tmp_path / "save", LAYOUTS["dp2"], mode="save_fully_reshardable", ckpt=ckpt,
                   overrides=DISTRIBUTED)
    loaded = _world(task_assets, tmp_path / "load", LAYOUTS["dp2"], mode="load", ckpt=ckpt, overrides=DISTRIBUTED)
    _assert_equal(saved["at_save"], loaded["at_load"])
    _assert_equal(saved["after"], loaded["after"])


def test_a_background_save_overlaps_the_next_step_and_resumes_exactly(task_assets, tmp_path):
    """checkpoint.async_save at DP2 with the distributed optimizer: the save returns with the files unwritten, the
    next step runs while the writer is held (so the overlap is certain), and the checkpoint then finished holds
    the state at the save: a run loading it takes the same step to the same weights and losses, bit for bit."""
    ckpt = tmp_path / "ckpt"
    saved = _world(task_assets, tmp_path / "save", LAYOUTS["dp2"], mode="async", ckpt=ckpt, overrides=DISTRIBUTED)
    assert saved["incomplete_during_step"] and saved["finished"] == 1
    loaded = _world(task_assets, tmp_path / "load", LAYOUTS["dp2"], mode="load", ckpt=ckpt, overrides=DISTRIBUTED)
    _assert_equal(saved["at_save"], loaded["at_load"])
    assert loaded["metrics"] == saved["metrics"]
    _assert_equal(saved["after"], loaded["after"])


def test_ppo_critic_is_saved_beside_the_policy_and_resumes_exactly(task_assets, megatron_world, tmp_path):
    """advantage_estimator ppo: the value model and its optimizer go to `critic` beside the policy checkpoint; the
    resumed worker's next step (policy and critic: value_loss, critic_grad_norm) equals the uninterrupted one's."""
    def ppo_worker():
        return make_worker(*task_overrides(task_assets), "trainer.micro_batch_size=2", "trainer.optimizer.lr=0.01",
                           "trainer.loss.advantage_estimator=ppo", "trainer.critic.lr=0.01")

    def step(worker) -> dict:
        samples = fixed_samples()
        for sample, reward in zip(samples, [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]):
            sample.reward = reward
        return rl_step(worker, samples)

    first = ppo_worker()
    step(first)
    step(first)
    first.save_checkpoint(str(tmp_path / "step" / "trainer"))
    assert (tmp_path / "step" / "critic" / "metadata.json").is_file()
    resumed = ppo_worker()
    resumed.load_checkpoint(str(tmp_path / "step" / "trainer"))
    assert step(first) == step(resumed)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_step_with_non_finite_gradients_is_not_applied(task_assets, megatron_world, bad):
    """A NaN or inf advantage makes the loss and every gradient non-finite: the step is skipped (counted in
    `skipped_steps`, grad norm NaN), the weights and the optimizer are as before it, and the next good step is
    the step an untouched worker takes. On main at a706c6e the NaN step was applied: every weight became NaN."""
    import math

    skipped, untouched = _worker(task_assets), _worker(task_assets)
    before = export_state(skipped)
    metrics = rl_step(skipped, fixed_samples(), [bad] + ADVANTAGES[1:])
    assert metrics["skipped_steps"] == 1 and math.isnan(metrics["grad_norm"])
    _assert_equal(before, export_state(skipped))
    good = _step(skipped)
    assert good["skipped_steps"] == 0 and math.isfinite(good["grad_norm"])
    assert good == _step(untouched)
    _assert_equal(export_state(skipped), export_state(untouched))


def test_non_finite_weights_are_neither_saved_nor_synced(task_assets, megatron_world, tmp_path):
    """Weights that hold a NaN (whatever put it there) stop the save and the sync with one line on every rank;
    nothing is written where the checkpoint would go."""
    from slimish.trainer.schedule import NonFiniteWeights

    worker = _worker(task_assets)
    worker.save_checkpoint(str(tmp_path / "step_1" / "trainer"))  # finite: saved as usual
    name, param = next(iter(worker.step.policy.chunks[0].named_parameters()))
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteWeights, match=r"^1 weight tensor\(s\) hold NaN or inf .*not saving the checkpoint "
                                               r"step_2\. The last good checkpoint is untouched"):
        worker.save_checkpoint(str(tmp_path / "step_2" / "trainer"))
    assert not (tmp_path / "step_2").exists()
    with pytest.raises(NonFiniteWeights, match="not sending weight version 2 to the engines"):
        worker.sync_weights(2)


def test_moe_checkpoint_of_a_single_optimizer_is_one_line(task_assets, tiny_moe_models, megatron_world, tmp_path,
                                                          monkeypatch):
    """A mixture-of-experts checkpoint saved when the experts shared the optimizer with the rest (slimish b8785f8 and
    older, at expert_parallel 1: here by undoing `_mark_expert_data_parallel`) is refused in one line naming what to
    do, not by Megatron's loader listing every key."""
    import slimish.trainer.model

    assets = {**task_assets, "model": str(tiny_moe_models["qwen3_moe"])}
    with monkeypatch.context() as patch:
        patch.setattr(slimish.trainer.model, "_mark_expert_data_parallel", lambda model, config: None)
        old = _worker(assets)
    old.save_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match=r"optimizer of 1 part\(s\), this model's has 2") as err:
        _worker(assets).load_checkpoint(str(tmp_path / "ckpt"))
    assert "\n" not in str(err.value)


# A GLM-4.5 MoE model at parallel.expert_tensor_parallel=1 and TP2: each expert whole on both ranks (expert data
# parallel 2); with EP2 too, the experts split between them. (Megatron's MoE at TP > 1 trains with sequence
# parallelism.) (ranks, TP, PP, overrides)
EXPERT_LAYOUTS = {"tp2-etp1": (2, 2, 1, ("parallel.sequence_parallel=true", "parallel.expert_tensor_parallel=1")),
                  "tp2-etp1-ep2": (2, 2, 1, ("parallel.sequence_parallel=true", "parallel.expert_tensor_parallel=1",
                                             "parallel.expert_parallel=2")),
                  "tp1": (1, 1, 1, ())}


@pytest.mark.parametrize("optimizer", [(), DISTRIBUTED], ids=["plain", "distributed"])
def test_expert_tensor_parallel_checkpoint_resumes_exactly_and_at_other_layouts(task_assets, tiny_moe_models,
                                                                               tmp_path, optimizer):
    """Saved at ETP1 x TP2, the checkpoint (model and Adam state, the experts' in an optimizer part of their own at
    every layout: `trainer.model._mark_expert_data_parallel`) resumes bit-exactly at the same layout, and loads at
    one rank and at ETP1 x TP2 x EP2 (the next step then differs by reduction order only). With the distributed
    optimizer the experts' Adam state is sharded over their data-parallel group of 2 (expert weights with
    prepended layer and expert axes, gated fc1 split in two: `slimish.trainer.optimizer_shards`' boxes)."""
    assets = {**task_assets, "model": str(tiny_moe_models["glm4_moe"])}

    def world(name: str, mode: str) -> dict:
        *layout, overrides = EXPERT_LAYOUTS[name]
        return _world(assets, tmp_path / f"{mode}-{name}", tuple(layout), mode=mode, ckpt=tmp_path / "ckpt",
                      overrides=overrides + optimizer)

    saved = world("tp2-etp1", "save")
    same = world("tp2-etp1", "load")
    _assert_equal(saved["at_save"], same["at_load"])
    _assert_equal(saved["after"], same["after"])  # the Adam moments and step came back exactly
    for other in ("tp1", "tp2-etp1-ep2"):
        loaded = world(other, "load")
        _assert_equal(saved["at_save"], loaded["at_load"])
        assert loaded["metrics"]["pg_loss"] == pytest.approx(saved["metrics"]["pg_loss"], abs=1e-5)
        for name, tensor in saved["after"].items():
            diff = (tensor - loaded["after"][name]).abs()
            # A key bias adds the same amount to each score of a query, which the softmax ignores: its gradient is
            # rounding noise, which Adam turns into moves of up to ~lr (measured: max 1e-4, mean 2e-5 at TP1).
            noise_only = name.endswith("k_proj.bias")
            assert diff.max() <= 1e-3 and (noise_only or diff.mean() <= 1e-6), (other, name)


# trainer.optimizer.adam=te_fused with Transformer Engine's FusedAdam stood in for (`tests.kit.fused_adam`: its step
# count an int in each param group, no parameter's state holding one; TE is absent here).
FUSED = ("trainer.optimizer.adam=te_fused",)


@pytest.fixture()
def stand_in_fused_adam(monkeypatch):
    from tests.kit.fused_adam import keep_megatron_adam, use_stand_in

    keep_megatron_adam(monkeypatch)
    use_stand_in(monkeypatch)


def _adams(worker) -> list:
    from slimish.trainer.checkpoint import adams

    optimizer = worker.step.policy.optimizer
    return [adam for part in getattr(optimizer, "chained_optimizers", [optimizer]) for adam in adams(part)]


def _group_steps(worker) -> set:
    return {group.get("step") for adam in _adams(worker) for group in adam.param_groups if group["params"]}


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed", "plain"])
def test_fused_adam_resumes_exactly(task_assets, megatron_world, tmp_path, stand_in_fused_adam, distributed):
    """Megatron builds exactly the Adam asked for (not the first that imports); FusedAdam's step count (an int per
    param group) is saved and loaded with its moments, by the distributed optimizer and the plain one alike: the
    resumed worker continues exactly like the uninterrupted one, and the step count goes on from 2 to 3."""
    from tests.kit.fused_adam import StandInFusedAdam

    overrides = FUSED + (("trainer.optimizer.distributed=true",) if distributed else ())
    first = _worker(task_assets, overrides)
    assert {type(adam) for adam in _adams(first)} == {StandInFusedAdam}
    _step(first)
    _step(first)
    assert _group_steps(first) == {2}
    first.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = _worker(task_assets, overrides)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    steps = _group_steps(resumed)
    assert steps == {2} and all(type(step) is int for step in steps)
    assert not any("step" in state for adam in _adams(resumed) for state in adam.state.values())
    _assert_equal(export_state(first), export_state(resumed))
    assert _step(first) == _step(resumed)
    assert _group_steps(resumed) == {3}
    _assert_equal(export_state(first), export_state(resumed))


@pytest.mark.parametrize("saved_with,loaded_with", [("torch", "te_fused"), ("te_fused", "torch")])
def test_a_distributed_optimizer_checkpoint_loads_into_the_other_adam(task_assets, megatron_world, tmp_path,
                                                                     stand_in_fused_adam, saved_with, loaded_with):
    """The distributed optimizer's checkpoint holds the step count once, in the param groups: torch's AdamW (a float
    there, a tensor per parameter when it runs) and FusedAdam (an int per group) each resume from the other's.
    The stand-in makes torch's update, so the resumed step is the uninterrupted one's exactly."""
    distributed = ("trainer.optimizer.distributed=true",)
    first = _worker(task_assets, distributed + (f"trainer.optimizer.adam={saved_with}",))
    _step(first)
    _step(first)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    expected, expected_state = _step(first), export_state(first)  # before another Adam is built in this process
    resumed = _worker(task_assets, distributed + (f"trainer.optimizer.adam={loaded_with}",))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    if loaded_with == "te_fused":
        assert _group_steps(resumed) == {2} and all(type(step) is int for step in _group_steps(resumed))
    else:
        steps = [state["step"] for adam in _adams(resumed) for state in adam.state.values()]
        assert steps and all(step.item() == 2 for step in steps)
        assert len({id(step) for step in steps}) == len(steps), "each parameter its own step tensor"
    assert _step(resumed) == expected
    _assert_equal(export_state(resumed), expected_state)


def test_a_plain_optimizer_checkpoint_loads_into_its_own_adam_only(task_assets, megatron_world, tmp_path,
                                                                  stand_in_fused_adam):
    first = _worker(task_assets, FUSED)
    _step(first)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = _worker(task_assets, ("trainer.optimizer.adam=torch",))
    with pytest.raises(CheckpointError, match="te_fused Adam, and this run builds torch: set "
                                              "trainer.optimizer.adam=te_fused to resume from it"):
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
