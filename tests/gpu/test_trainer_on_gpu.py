"""The trainer's RL step, SFT step, checkpoint and weight-sync export on the GPU (one rank: NCCL refuses two ranks on
one GPU), against the same steps on the CPU in a process that sees no GPU. GPU kernels differ from the CPU's (fused
attention paths, reduction order): the tolerances are fp32 ones, looser than the emulated tier's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.test_worker_layouts import _run as run_layout

ON_CPU = {"SLIMISH_EMULATED_GPU": "0", "CUDA_VISIBLE_DEVICES": ""}


def _run(task_assets, out: Path, *, env: dict[str, str] | None, overrides: tuple[str, ...] = (),
         dtype: str = "float32", extra: tuple[str, ...] = ()) -> dict:
    return run_layout(task_assets, out, world_size=1, tp=1, dtype=dtype, overrides=overrides,
                      extra=("--more-steps", *extra), env=env, timeout=600)[0]


@pytest.mark.parametrize("overrides", [(), ("trainer.loss.advantage_estimator=ppo", "trainer.critic.lr=0.01"),
                                       ("trainer.max_tokens_per_micro_batch=14", "trainer.logprob_chunk_tokens=3")],
                         ids=["grpo", "ppo", "packed-chunked"])
def test_a_step_on_the_gpu_is_the_cpu_step(task_assets, tmp_path, overrides):
    gpu = _run(task_assets, tmp_path / "gpu", env=None, overrides=overrides)
    cpu = _run(task_assets, tmp_path / "cpu", env=ON_CPU, overrides=overrides)
    assert torch.allclose(gpu["before"], cpu["before"], atol=1e-4)
    assert torch.allclose(gpu["after"], cpu["after"], atol=1e-3)
    assert gpu["metrics"]["grad_norm"] == pytest.approx(cpu["metrics"]["grad_norm"], rel=1e-3)
    for name, tensor in cpu["state"].items():  # what weight sync sends, after the step
        assert (gpu["state"][name] - tensor).abs().max() <= 1e-3, name
    assert gpu["sft"]["sft_loss"] == pytest.approx(cpu["sft"]["sft_loss"], rel=1e-4)
    assert torch.equal(gpu["after_load"], gpu["after"]), "the checkpoint gives back the weights it was saved with"
    exported = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in gpu["state"].values()])
    assert torch.equal(gpu["flat"], exported), "weight sync's buckets hold the exported bytes"
    # The engines' expected checksums (one dict per engine rank) from the tensors on the device (SGLang's GPU hash of
    # each fused engine parameter) cover the same parameters as those from their CPU copies (SHA-256); the values
    # differ by hash: the hash follows the tensor's device (on the H200, 2026-11-28, the two-rank ones differed as
    # well, as they must; only the emulated GPU, whose stand-in hash is the CPU's, makes them equal).
    for on_device, on_host in ((gpu["checksums"], gpu["cpu_checksums"]),
                               (gpu["checksums_tp2"], gpu["cpu_checksums_tp2"])):
        assert [rank.keys() for rank in on_device] == [rank.keys() for rank in on_host]
        assert all(len(value) == 16 for rank in on_device for value in rank.values())
    assert len(gpu["checksums_tp2"]) == 2 and gpu["checksums_tp2"][0] != gpu["checksums_tp2"][1]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_moe_step_on_the_gpu_is_the_cpu_step(task_assets, tiny_moe_models, tmp_path, family):
    """A tiny Qwen3-MoE (softmax router) and DeepSeek-V3 (grouped sigmoid router, shared expert, multi-latent
    attention): the RL step at one rank on the GPU, without Transformer Engine (as the lent machine is), against the
    CPU's, and the export weight sync sends."""
    assets = {**task_assets, "model": str(tiny_moe_models[family])}
    gpu = run_layout(assets, tmp_path / "gpu", world_size=1, tp=1, env=None, timeout=600)[0]
    cpu = run_layout(assets, tmp_path / "cpu", world_size=1, tp=1, env=ON_CPU, timeout=600)[0]
    assert torch.allclose(gpu["before"], cpu["before"], atol=1e-4)
    assert torch.allclose(gpu["after"], cpu["after"], atol=1e-3)
    assert gpu["metrics"]["grad_norm"] == pytest.approx(cpu["metrics"]["grad_norm"], rel=1e-3)
    assert any(".mlp.experts." in name for name in cpu["state"])
    for name, tensor in cpu["state"].items():
        assert (gpu["state"][name] - tensor).abs().max() <= 1e-3, name


def test_a_bf16_step_on_the_gpu_tracks_the_fp32_cpu_step(task_assets, tmp_path):
    """model.dtype=bfloat16 on the GPU (bf16 kernels, Megatron's mixed-precision optimizer with fp32 main weights)
    against the fp32 step on the CPU, within bf16 precision: the tolerances of the CPU tier's bf16-at-TP2 test
    (tests/trainer/test_worker_layouts.py)."""
    gpu = _run(task_assets, tmp_path / "gpu", env=None, dtype="bfloat16")
    cpu = _run(task_assets, tmp_path / "cpu", env=ON_CPU)
    assert gpu["metrics"]["ppo_kl"] == 0.0, "same weights, same micro-batches: the ratio is exactly 1"
    assert gpu["metrics"]["grad_norm"] == pytest.approx(cpu["metrics"]["grad_norm"], rel=1e-2)
    assert torch.allclose(gpu["before"], cpu["before"], atol=2e-2)
    moved, expected = (gpu["after"] - gpu["before"]).sum(1), (cpu["after"] - cpu["before"]).sum(1)
    assert torch.equal(moved.sign(), expected.sign()) and torch.allclose(moved, expected, rtol=0.25)
    assert gpu["state"]["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16  # what weight sync sends
    for name, tensor in cpu["state"].items():
        diff = (gpu["state"][name].float() - tensor).abs()  # bf16 rounding: up to 2^-8 of a weight's size
        assert diff.max() <= 0.025 and diff.mean() <= 1e-3 + 2 ** -8 * tensor.abs().mean(), name


def test_an_offload_round_trip_on_the_gpu_frees_its_memory_and_changes_nothing(task_assets, tmp_path, capsys):
    """PPO in bf16 (policy with fp32 main params and Adam moments, critic, reference model): every role offloaded to
    host memory right after the RL step (optimizer state and gradients, then the models), a checkpoint saved while
    offloaded, and onloaded, as a colocated trainer does while its engines generate. The GPU memory the trainer had
    allocated goes (with cuBLAS's workspaces, 64 MiB of the 68 on an H200), and the run goes on bit-exactly as the
    same run without the round trip: logprobs, exported weights, SFT step, the checkpoint saved while offloaded."""
    overrides = ("trainer.loss.advantage_estimator=ppo", "trainer.critic.lr=0.01")
    kept = _run(task_assets, tmp_path / "kept", env=None, overrides=overrides, dtype="bfloat16")
    moved = _run(task_assets, tmp_path / "moved", env=None, overrides=overrides, dtype="bfloat16",
                 extra=("--offload",))
    figures = moved["offload"]
    held, without_state, during, after_save, after = figures["held"]
    assert held > without_state > during == after_save == 0 and after == held, figures["held"]
    if figures["cuda_allocated"]:  # a real GPU (not EMULATE=1)
        before, offloaded, back = figures["cuda_allocated"]
        with capsys.disabled():
            print(f"\noffload: roles held {held / 2**20:.2f} MiB; allocated {before / 2**20:.2f} MiB -> "
                  f"{offloaded / 2**20:.2f} MiB offloaded -> {back / 2**20:.2f} MiB back; "
                  f"offload {figures['time_offload_s'] * 1e3:.1f} ms, onload {figures['time_onload_s'] * 1e3:.1f} ms")
        # Offloaded, the trainer holds (almost) nothing on the GPU: cuBLAS's workspaces go too, and come back at
        # the next matmul, not at onload (an H200: 67.90 MiB -> 0.01 MiB -> 3.90 MiB, the roles' 3.86 MiB back).
        assert offloaded <= 2**20 and back - offloaded >= held
    for key in ("before", "after", "after_load"):
        assert torch.equal(moved[key], kept[key]), key
    assert moved["sft"] == kept["sft"]
    assert all(torch.equal(moved["state"][name], t) for name, t in kept["state"].items())


def test_half_the_adam_state_in_host_memory_on_the_gpu_is_the_step_without(task_assets, tmp_path):
    """trainer.optimizer.cpu_offload=0.5 in bf16 with the distributed optimizer: half of the Adam moments (and their
    fp32 main weights) in host memory, updated there by torch's fused CPU AdamW; the rest on the GPU, by
    trainer.optimizer.adam (auto: TE's FusedAdam where TE imports). The step, an SFT step and the checkpoint's load
    are those of the run without the offload, within bf16 rounding: the two Adams' kernels round the fp32 main
    weights differently (on the emulated GPU they are equal). Not yet run on a GPU (docs/gpu.md). Named without
"offload": the GPU battery runs those alone, for their memory figures, and this one measures none."""
    overrides = ("trainer.optimizer.distributed=true",)
    kept = _run(task_assets, tmp_path / "kept", env=None, overrides=overrides, dtype="bfloat16")
    moved = _run(task_assets, tmp_path / "moved", env=None, dtype="bfloat16",
                 overrides=overrides + ("trainer.optimizer.cpu_offload=0.5",))
    assert kept["moments"]["host"] == 0 < kept["moments"]["device"]
    assert 0 < moved["moments"]["host"] and 0 < moved["moments"]["device"]
    assert moved["moments"]["host"] + moved["moments"]["device"] == kept["moments"]["device"]
    assert torch.equal(moved["before"], kept["before"])
    assert moved["metrics"]["grad_norm"] == pytest.approx(kept["metrics"]["grad_norm"], rel=1e-3)
    assert torch.allclose(moved["after"], kept["after"], atol=1e-2)
    for name, tensor in kept["state"].items():
        diff = (moved["state"][name].float() - tensor.float()).abs()
        assert diff.max() <= 2 ** -7 * tensor.float().abs().max(), name
    assert moved["sft"]["sft_loss"] == pytest.approx(kept["sft"]["sft_loss"], rel=1e-2)
    assert torch.equal(moved["after_load"], moved["after"]), "the checkpoint gives back the weights it was saved with"
