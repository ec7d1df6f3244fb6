"""The emulated-GPU tier: the trainer's steps with its modules, Megatron's buffers, optimizer state and per-step
data on a device that is not the CPU (`slimish.compat.emulated_gpu`), with the CPU's arithmetic behind it.

A tensor left on the CPU beside one on the device raises there as it would on a GPU, and a collective on a group that
is NCCL on a GPU refuses a CPU tensor. The steps (`tests/trainer/worker_rank.py` with SLIMISH_EMULATED_GPU=1) must
then give the numbers of the same steps on the CPU: every advantage estimator (PPO's critic included), the reference
model, padded and packed micro-batches with the chunked logprob head, TP2 / PP2 / DP2, the weight-sync export,
flatten and checksums, an SFT step, checkpoint save and load, Megatron's optimizer CPU offload (as without it). And
undoing one piece of device discipline (a micro-batch not moved, a factory without its device, a reduction on the
CPU) fails the tier, naming the op.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.trainer.test_worker_layouts import PACKED
from tests.trainer.test_worker_layouts import _run as run_layout

pytestmark = pytest.mark.emulated_gpu


def _run(task_assets, out: Path, *, emulated: bool, world_size: int = 1, tp: int = 1, **kwargs) -> list[dict]:
    return run_layout(task_assets, out, world_size=world_size, tp=tp,
                      env={"SLIMISH_EMULATED_GPU": "1" if emulated else "0"}, **kwargs)


def _both(task_assets, tmp_path: Path, **kwargs) -> tuple[list[dict], list[dict]]:
    """(emulated-GPU results, CPU results) of the same run, the two run side by side."""
    with ThreadPoolExecutor(2) as pool:
        gpu = pool.submit(_run, task_assets, tmp_path / "gpu", emulated=True, **kwargs)
        cpu = pool.submit(_run, task_assets, tmp_path / "cpu", emulated=False, **kwargs)
        return gpu.result(), cpu.result()


@pytest.fixture(scope="module")
def cpu_one_rank(task_assets, tmp_path_factory):
    """estimator -> the one-rank CPU run's results with that estimator's overrides (made once, on first use)."""
    cache: dict[str, dict] = {}

    def get(estimator: str) -> dict:
        if estimator not in cache:
            cache[estimator] = _run(task_assets, tmp_path_factory.mktemp(f"cpu-{estimator}"), emulated=False,
                                    overrides=ESTIMATOR_OVERRIDES[estimator])[0]
        return cache[estimator]

    return get


def _assert_same_step(gpu: dict, cpu: dict, *, rows: list[int] | None = None) -> None:
    """`gpu`'s step is `cpu`'s: the same layout (`rows` None; equal to fp32 rounding: the same CPU kernels behind
    the emulated device), or a rank holding `rows` of the one-rank `cpu` (the tolerances of
    test_worker_layouts: reduction order differs between layouts)."""
    same_layout = rows is None
    for key, atol in (("before", 1e-5), ("after", 1e-5 if same_layout else 1e-4)):
        if gpu[key] is not None:
            assert torch.allclose(gpu[key], cpu[key] if same_layout else cpu[key][rows], atol=atol), key
        elif same_layout:
            assert cpu[key] is None, key
    assert gpu["advantages"] == pytest.approx(cpu["advantages"], abs=1e-5)
    assert gpu["parity"]["logprob_abs_diff_mean"] == pytest.approx(cpu["parity"]["logprob_abs_diff_mean"], abs=1e-5)
    assert gpu["metrics"].keys() == cpu["metrics"].keys()
    for key in ("pg_loss", "value_loss", "kl_ref", "ppo_kl"):
        if key in cpu["metrics"]:
            assert gpu["metrics"][key] == pytest.approx(cpu["metrics"][key], abs=1e-5), key
    assert gpu["metrics"]["grad_norm"] == pytest.approx(cpu["metrics"]["grad_norm"], rel=1e-4)
    if gpu["state"]:  # rank 0: the whole model after the step, as weight sync exports it
        assert gpu["state"].keys() == cpu["state"].keys()
        for name, tensor in cpu["state"].items():
            diff = (gpu["state"][name] - tensor).abs()
            assert diff.max() <= (1e-4 if same_layout else 1e-3) and diff.mean() <= 1e-6, name


ESTIMATOR_OVERRIDES = {
    "grpo": (),
    "dr_grpo": ("trainer.loss.advantage_estimator=dr_grpo",),
    "rloo": ("trainer.loss.advantage_estimator=rloo",),
    "reinforce_plus_plus": ("trainer.loss.advantage_estimator=reinforce_plus_plus", "trainer.loss.reward_kl_coef=0.5"),
    "reinforce_plus_plus_baseline": ("trainer.loss.advantage_estimator=reinforce_plus_plus_baseline",),
    # GSPO's sequence-level ratio, with sequence-level truncated importance sampling: the segment sums
    "gspo": ("trainer.loss.advantage_estimator=gspo", "trainer.loss.is_level=sequence", "trainer.loss.tis_cap=2"),
    "ppo": ("trainer.loss.advantage_estimator=ppo", "trainer.loss.reward_kl_coef=0.5", "trainer.critic.lr=0.01"),
}


def test_every_estimator_is_covered():
    from slimish.trainer.estimators import ESTIMATORS

    assert set(ESTIMATOR_OVERRIDES) == set(ESTIMATORS)


@pytest.mark.parametrize("estimator", sorted(ESTIMATOR_OVERRIDES))
def test_an_rl_step_on_the_emulated_gpu_is_the_cpu_step(task_assets, tmp_path, cpu_one_rank, estimator):
    """One rank, a reference model (kl_coef 0.1), padded micro-batches: the step of each estimator."""
    (gpu,) = _run(task_assets, tmp_path, emulated=True, overrides=ESTIMATOR_OVERRIDES[estimator])
    _assert_same_step(gpu, cpu_one_rank(estimator))


def test_sync_export_checkpoint_and_sft_on_the_emulated_gpu(task_assets, tmp_path):
    """After the RL step: the export flattened into weight-sync buckets holds exactly the exported tensors' bytes;
    the expected engine checksums made from the tensors on the device (the GPU's code path: fused tensors built on
    the device) equal those made from their CPU copies, for engines of one rank and of two (slices and padding made
    on the device); a checkpoint saved, an SFT step taken and the checkpoint
    loaded give back the step's logprobs; all as on the CPU."""
    (gpu,), (cpu,) = _both(task_assets, tmp_path, extra=("--more-steps",))
    _assert_same_step(gpu, cpu)
    exported = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in gpu["state"].values()])
    assert torch.equal(gpu["flat"], exported)
    assert gpu["checksums"] == gpu["cpu_checksums"] and len(gpu["checksums"][0]) > 10
    assert gpu["checksums_tp2"] == gpu["cpu_checksums_tp2"] and len(gpu["checksums_tp2"]) == 2
    assert gpu["checksums_tp2"][0] != gpu["checksums_tp2"][1], "each rank its own slices"
    assert gpu["padded_checksums"] == gpu["cpu_padded_checksums"] and len(gpu["padded_checksums"]) == 2
    assert gpu["sft"]["sft_loss"] == pytest.approx(cpu["sft"]["sft_loss"], rel=1e-5)
    assert torch.equal(gpu["after_load"], gpu["after"]), "the checkpoint gives back the weights it was saved with"


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_moe_step_on_the_emulated_gpu_without_transformer_engine(task_assets, tiny_moe_models, tmp_path, family):
    """A mixture-of-experts model's RL step with Megatron-Core left as it is on a CUDA machine without Transformer
    Engine (`worker_rank.as_on_cuda`: the CPU shim's TE names undone; on main at a706c6e the router raised
    NameError: te_general_gemm there) is the CPU step: the trainer itself makes Megatron's MoE
    utilities runnable without TE (`slimish.compat.megatron_te_absent`), on every device."""
    assets = {**task_assets, "model": str(tiny_moe_models[family])}
    (gpu,), (cpu,) = _both(assets, tmp_path, extra=("--as-on-cuda",))
    _assert_same_step(gpu, cpu)
    assert any(".mlp.experts." in name for name in gpu["state"]), "the export holds the experts"


# Megatron's optimizer CPU offload (trainer.optimizer.cpu_offload): the distributed optimizer in bf16
CPU_OFFLOAD = ("model.dtype=bfloat16", "trainer.optimizer.distributed=true")

OFFLOAD_LAYOUTS = {  # id -> (world size, overrides)
    "ppo-bf16": (1, ESTIMATOR_OVERRIDES["ppo"] + ("model.dtype=bfloat16",)),  # critic, reference, fp32 main params
    "dp2-distributed-optimizer": (2, ("trainer.optimizer.distributed=true",)),  # sharded main params and moments
    # half of the optimizer in host memory already: the other half (and the grads, the weights) moves
    "dp2-cpu-offload-half": (2, CPU_OFFLOAD + ("trainer.optimizer.cpu_offload=0.5",)),
}


@pytest.mark.parametrize("layout", list(OFFLOAD_LAYOUTS))
def test_an_offload_round_trip_on_the_emulated_gpu_changes_nothing(task_assets, tmp_path, layout):
    """Every role offloaded to host memory right after the RL step, as a colocated step does (optimizer state and
    gradients, then the models), a checkpoint saved while offloaded, and onloaded: the offloads free all the roles
    held on the device, the save leaves them offloaded, and the run goes on bit-exactly as without any of it: the
    logprobs after the step, the exported weights, an SFT step on the moved Adam state, and the logprobs after
    loading the checkpoint saved while offloaded."""
    world_size, overrides = OFFLOAD_LAYOUTS[layout]

    def run(name: str, *extra: str):
        return pool.submit(_run, task_assets, tmp_path / name, emulated=True, world_size=world_size,
                           overrides=overrides, extra=("--more-steps", *extra))

    with ThreadPoolExecutor(2) as pool:
        moved, kept = run("offload", "--offload"), run("kept")
        moved, kept = moved.result(), kept.result()
    for rank_moved, rank_kept in zip(moved, kept):
        figures = rank_moved["offload"]
        held, without_state, during, after_save, after = figures["held"]
        assert held > without_state > during == after_save == 0 and after == held, figures["held"]
        assert figures["offload_freed_bytes"] >= held and 0 < figures["offload_bytes"] <= held
        for key in ("before", "after", "after_load"):
            assert (rank_moved[key] is None and rank_kept[key] is None) or torch.equal(rank_moved[key],
                                                                                       rank_kept[key]), key
        assert rank_moved["sft"] == rank_kept["sft"]
        assert rank_moved["state"].keys() == rank_kept["state"].keys()
        assert all(torch.equal(rank_moved["state"][name], t) for name, t in rank_kept["state"].items())


CPU_OFFLOAD_LAYOUTS = {  # id -> (world size, overrides, extra worker_rank options)
    # all of it in host memory, sharded over DP2; the copies overlapped (one CPU AdamW per parameter)
    "dp2-all": (2, ("trainer.optimizer.cpu_offload=true",), ()),
    # half of it: torch's AdamW on the GPU for the rest; the copies in order (one CPU AdamW)
    "half-no-overlap": (1, ("trainer.optimizer.cpu_offload=0.5", "trainer.optimizer.cpu_offload_overlap=false"), ()),
    # PPO (the critic offloaded too), half, with TE's FusedAdam (its stand-in) on the GPU
    "ppo-half-te-fused": (1, ESTIMATOR_OVERRIDES["ppo"] + ("trainer.optimizer.cpu_offload=0.5",
                                                           "trainer.optimizer.adam=te_fused"),
                          ("--stand-in-fused-adam",)),
}


@pytest.mark.parametrize("layout", list(CPU_OFFLOAD_LAYOUTS))
def test_megatron_cpu_offload_on_the_emulated_gpu_is_the_step_without(task_assets, tmp_path, layout):
    """trainer.optimizer.cpu_offload: Megatron's HybridDeviceOptimizer keeps the Adam moments (and fp32 main
    weights) of that share of the parameters in host memory and updates them there with torch's AdamW. The RL step,
    the exported weights, an SFT step and the logprobs after loading a checkpoint are those of the same run without
    the offload (the weights within a bf16 rounding: torch's fused CPU AdamW and its device kernels round the fp32
    main weights differently). Megatron's own pieces that fail without CUDA or TE are made to run:
    `emulated_gpu.patch_hybrid_optimizer`, `megatron_te_absent`, and the checkpoint's load of it
    (`slimish.trainer.checkpoint`)."""
    world_size, overrides, extra = CPU_OFFLOAD_LAYOUTS[layout]
    kept_overrides = tuple(o for o in overrides if not o.startswith("trainer.optimizer.cpu_offload"))

    def run(name: str, chosen: tuple[str, ...]):
        return pool.submit(_run, task_assets, tmp_path / name, emulated=True, world_size=world_size,
                           overrides=CPU_OFFLOAD + chosen, extra=("--more-steps", *extra))

    with ThreadPoolExecutor(2) as pool:
        moved, kept = run("offload", overrides), run("kept", kept_overrides)
        moved, kept = moved.result(), kept.result()
    share = 1.0 if "trainer.optimizer.cpu_offload=true" in overrides else 0.5
    for rank_moved, rank_kept in zip(moved, kept):
        assert rank_kept["moments"]["host"] == 0 and rank_kept["moments"]["device"] > 0
        assert rank_moved["moments"]["host"] > 0
        total = rank_moved["moments"]["host"] + rank_moved["moments"]["device"]
        assert total == rank_kept["moments"]["device"]
        assert rank_moved["moments"]["host"] == total if share == 1 else 0 < rank_moved["moments"]["device"] < total
        for key in ("before", "after", "after_load"):
            assert (rank_moved[key] is None and rank_kept[key] is None) or torch.equal(rank_moved[key],
                                                                                       rank_kept[key]), key
        assert rank_moved["metrics"]["grad_norm"] == rank_kept["metrics"]["grad_norm"]
        assert rank_moved["sft"] == rank_kept["sft"]
        for name, tensor in rank_kept["state"].items():
            diff = (rank_moved["state"][name].float() - tensor.float()).abs()
            assert diff.max() <= 2 ** -8 * tensor.float().abs().max() and diff.mean() <= 1e-6, name


@pytest.mark.parametrize("adam", ["torch", "te_fused"])
def test_a_checkpoint_of_megatron_cpu_offload_resumes_exactly_on_the_emulated_gpu(task_assets, tmp_path, adam):
    """Two steps, a checkpoint, a third step; a new run loads the checkpoint and takes the third step: the same
    weights after it, bit for bit, with half of the optimizer in host memory at DP2 (the Adam on the GPU torch's or
    TE's FusedAdam stand-in). Loading needs slimish's help: Megatron's optimizer moves the GPU's torch AdamW state to
    the CPU on load, and its checkpoint holds the two Adam classes (`slimish.trainer.checkpoint`)."""
    from tests.multiproc import run_world

    script = Path(__file__).with_name("checkpoint_rank.py")
    overrides = (*CPU_OFFLOAD, "trainer.optimizer.cpu_offload=0.5", f"trainer.optimizer.adam={adam}")
    stand_in = ("--stand-in-fused-adam",) if adam == "te_fused" else ()

    def world(mode: str) -> dict:
        run_world(script, world_size=2, env={"SLIMISH_EMULATED_GPU": "1"},
                  args=["--tp", "1", "--hf", task_assets["model"], "--data", task_assets["train"], "--mode", mode,
                        "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / mode), *stand_in,
                        *(a for o in overrides for a in ("--set", o))])
        return torch.load(tmp_path / mode / "rank0.pt")

    saved, loaded = world("save"), world("load")
    for key, other in (("at_save", "at_load"), ("after", "after")):
        assert saved[key].keys() == loaded[other].keys()
        assert all(torch.equal(saved[key][name], loaded[other][name]) for name in saved[key]), key
    assert saved["metrics"]["grad_norm"] == loaded["metrics"]["grad_norm"]


# REINFORCE++ (whitening statistics reduced over the data-parallel ranks) with sequence-level importance sampling
# (segment sums in the loss): what the dropped-device runs below run, and must pass without the drop.
SEQUENCE_IS = ("trainer.loss.is_level=sequence", "trainer.loss.tis_cap=2")
DROP_RUN = ESTIMATOR_OVERRIDES["reinforce_plus_plus"] + SEQUENCE_IS

LAYOUTS = {  # id -> (tp, pp, estimator, extra overrides)
    "tp2": (2, 1, "grpo", ()),
    "pp2-packed-chunked": (1, 2, "grpo", PACKED),
    "dp2-distributed-optimizer-packed": (1, 1, "grpo", ("trainer.optimizer.distributed=true", *PACKED)),
    "ppo-tp2": (2, 1, "ppo", ()),
    # Sequence parallelism: the sequence split over TP between blocks, the heads' gather, the norms' all-reduce
    "tp2-sequence-parallel-packed": (2, 1, "grpo", ("parallel.sequence_parallel=true", *PACKED)),
    "ppo-tp2-sequence-parallel": (2, 1, "ppo", ("parallel.sequence_parallel=true",)),
    # Context parallelism: each rank's share of every sequence, the keys and values all-gathered, the heads' gather
    "cp2-packed": (1, 1, "grpo", ("parallel.context_parallel=2", *PACKED)),
    "ppo-cp2": (1, 1, "ppo", ("parallel.context_parallel=2",)),
    "ppo-pp2": (1, 2, "ppo", ()),
    "reinforce_plus_plus-dp2-sequence-is": (1, 1, "reinforce_plus_plus", SEQUENCE_IS),
    # Selective recompute: the norms' outputs freed after the forward and recomputed into the same storage
    "tp2-selective-recompute": (2, 1, "grpo", ("trainer.recompute=selective",
                                               "trainer.recompute_modules=[core_attn,layernorm,mlp]")),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_rank_layouts_on_the_emulated_gpu_match_one_cpu_rank(task_assets, tmp_path, cpu_one_rank, layout):
    """Two ranks (TP2, PP2 or DP2): Megatron's collectives, pipeline sends and the trainer's own reductions run on the
    emulated device through the NCCL stand-in; each rank's step is the one-rank CPU step (its rows of it)."""
    tp, pp, estimator, extra = LAYOUTS[layout]
    overrides = ESTIMATOR_OVERRIDES[estimator] + extra
    if overrides == DROP_RUN:
        # Against the CPU run of the same layout: with sequence-level IS this step's loss is ~6e-7 and Adam turns
        # the reduction-order noise of its tiny grads into 1e-3 differences between layouts (CPU DP2 vs one rank).
        gpu, cpu = _both(task_assets, tmp_path, world_size=2, tp=tp, pp=pp, overrides=overrides)
        for gpu_rank, cpu_rank in zip(gpu, cpu):
            _assert_same_step(gpu_rank, cpu_rank)
        return
    reference = cpu_one_rank(estimator)
    for result in _run(task_assets, tmp_path, emulated=True, world_size=2, tp=tp, pp=pp, overrides=overrides):
        _assert_same_step(result, reference, rows=result["rows"])
        if "trainer.recompute=selective" in overrides:  # each rank runs every row at TP2: twice the one rank's calls
            for module in ("self_attention.core_attention", "input_layernorm", "mlp"):
                assert result["train_calls"][module] == 2 * reference["train_calls"][module], module


@pytest.mark.parametrize("dropped,world_size,op", [
    ("microbatch", 1, "aten.embedding"),       # token ids left on the CPU reach the embedding's weight
    ("factory", 1, "aten.index_add"),          # segment totals made on the CPU meet per-token values
    ("collective", 2, "all_reduce on an NCCL group got a CPU tensor"),  # a DP reduction of a host tensor
])
def test_the_tier_fails_when_a_device_is_dropped(task_assets, tmp_path, dropped, world_size, op):
    """The run of the reinforce_plus_plus-dp2-sequence-is layout (which passes) with one piece of device discipline
    undone (`worker_rank.drop_device`) fails, naming the op; on the CPU alone the same code passes."""
    with pytest.raises(AssertionError) as failure:
        _run(task_assets, tmp_path, emulated=True, world_size=world_size, overrides=DROP_RUN,
             extra=("--drop-device", dropped))
    assert "DeviceMismatch" in str(failure.value) and op in str(failure.value)


# (world size, TP, overrides) of the layouts whose device memory is counted against `slimish plan`.
PLANNED_LAYOUTS = {"one-rank-fp32": (1, 1, ()), "one-rank-bf16": (1, 1, ("model.dtype=bfloat16",)),
                   "tp2": (2, 2, ()), "dp2-distributed-optimizer": (2, 1, ("trainer.optimizer.distributed=true",))}


@pytest.mark.parametrize("layout", list(PLANNED_LAYOUTS))
def test_the_plan_counts_the_state_megatron_holds(task_assets, tmp_path, layout):
    """The bytes the emulated GPU holds (each storage once, as CUDA's allocator counts them:
    `emulated_gpu.memory_allocated`) after the trainer's set-up are the policy's weights and fp32 gradient buffer,
    the reference model's weights (and in bf16 the optimizer's fp32 main weights, made with it); after a step,
    Adam's moments too: what `slimish plan` counts for them, within 1%, at one rank in fp32 and bf16, at TP2 and at
    DP2 with the distributed optimizer (its moments sharded; the parameters moved into its buffer). The activations:
    tests/planning/test_activations.py."""
    from slimish.config import load_config
    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.planning.memory import trainer_rank
    from slimish.planning.params import count_params
    from tests.kit.trainer import REPO

    world, tp, overrides = PLANNED_LAYOUTS[layout]
    results = run_layout(task_assets, tmp_path, world_size=world, tp=tp, overrides=overrides,
                         env={"SLIMISH_EMULATED_GPU": "1", "SLIMISH_EMULATED_GPU_MEMORY": "1"})
    cfg = load_config(REPO / "configs/quickstart_cpu.yaml", [
        f"model.hf_path={task_assets['model']}", f"data.path={task_assets['train']}", "eval.every=0", "sft.steps=0",
        "trainer.micro_batch_size=2", "trainer.loss.kl_coef=0.1", f"parallel.tensor_parallel={tp}",
        f"parallel.num_trainer_ranks={world}", *overrides])
    hf = read_hf_config(task_assets["model"])
    plan = trainer_rank(cfg, architecture_from_hf(hf), count_params(hf), prompt_tokens=0)
    assert plan.reference > 0, "kl_coef 0.1: the reference model is built"
    main_weights = plan.optimizer * 4 / 12 if cfg.model.dtype == "bfloat16" else 0.0  # of Adam's 8 + 4 bytes
    for result in results:
        held = result["device_bytes"]
        assert held["setup"] == pytest.approx(plan.weights + plan.grads + plan.reference + main_weights,
                                              rel=0.01), held
        assert held["after_step"] == pytest.approx(plan.weights + plan.grads + plan.optimizer + plan.reference,
                                                   rel=0.01), held
