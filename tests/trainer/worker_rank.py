"""One rank of a multi-process TrainerWorker test: the same fixed rollout at a given layout.

Launched by tests.multiproc.run_world:
  python tests/trainer/worker_rank.py --rank R --world-size N --port P --tp T [--pp P] [--dtype D] --hf DIR
      --data JSONL --out OUT
Writes OUT/rank{R}.pt with the response logprobs before and after one GRPO step with a KL penalty (None on a
pipeline stage other than the last), the step's advantages (fixed ones, or the configured estimator's from fixed
rewards) and metrics, the parity metrics of `rl_step.prepare`, the experts' ETP / EP / EDP sizes, and the whole-model
export
(`tests.kit.trainer.export_state`; empty except on rank 0); with --more-steps also what `more_steps` returns; with
--offload, every role is offloaded (as a colocated step does, a checkpoint saved meanwhile) and onloaded right after
the step ("offload": `offload_round_trip`'s figures); "weights_read": what reading the initial weights cost the
rank (with --whole-reads, whole HF tensors read and sliced, as before slice reads).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch

from slimish.sample import Sample
from slimish.trainer import rl_step
from tests.kit.samples import sample
from tests.kit.trainer import export_state, given_advantages, response_logprobs
from tests.kit.trainer import make_worker as make_kit_worker

REPO = Path(__file__).resolve().parents[2]


def fixed_samples() -> list[Sample]:
    """8 samples in 2 groups; responses and advantages fixed so every layout sees the same step. Prompts of 2 or 3
    tokens make consecutive micro-batches (of 2) differ in length, as pipeline stages must cope with."""
    return [sample(group_id=i // 4, index=i % 4, prompt="say 7", prompt_ids=[269, 221, 23 + i % 3][:2 + i // 2 % 2],
                   response_ids=[23 + i % 2, 0]) for i in range(8)]


def rank_args(*strings: str) -> argparse.Namespace:
    """--rank --world-size --port --tp [--pp] --hf --data plus the given string options, all required."""
    parser = argparse.ArgumentParser()
    for name in ("rank", "world-size", "port", "tp"):
        parser.add_argument(f"--{name}", type=int, required=True)
    for name in ("hf", "data", *strings):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--set", action="append", default=[], help="extra config overrides")
    parser.add_argument("--more-steps", action="store_true", help="also sync export, checkpoint and SFT (more_steps)")
    parser.add_argument("--drop-device", help="undo one piece of device discipline (drop_device)")
    parser.add_argument("--offload", action="store_true", help="offload and onload every role after the RL step")
    parser.add_argument("--as-on-cuda", action="store_true",
                        help="Megatron's CPU shim leaves what it does on a CUDA machine (as_on_cuda)")
    parser.add_argument("--whole-reads", action="store_true",
                        help="read whole HF tensors and slice them in memory, as before slice reads")
    parser.add_argument("--stand-in-fused-adam", action="store_true",
                        help="trainer.optimizer.adam=te_fused builds tests.kit.fused_adam's stand-in for TE's")
    return parser.parse_args()


def make_worker(args: argparse.Namespace):
    """A set-up TrainerWorker for this rank of the layout in `args` (quickstart config, small micro-batches, a KL
    penalty so that the reference model runs)."""
    if args.stand_in_fused_adam:
        from tests.kit.fused_adam import use_stand_in

        use_stand_in()
    return make_kit_worker(
        f"model.hf_path={args.hf}", f"data.path={args.data}", "trainer.micro_batch_size=2",
        "trainer.optimizer.lr=0.01", "trainer.loss.kl_coef=0.1", f"parallel.tensor_parallel={args.tp}",
        f"parallel.pipeline_parallel={args.pp}", f"parallel.num_trainer_ranks={args.world_size}",
        f"model.dtype={args.dtype}", *args.set, rank=args.rank, world_size=args.world_size, master_port=args.port)


def drop_device(what: str) -> None:
    """Undo one piece of the trainer's device discipline, to show that the emulated-GPU tier catches it:
    "microbatch" (a micro-batch is never moved to the device: its `.to()` stays on the CPU), "factory" (one tensor
    factory in the losses loses its device=) or "collective" (a reduction is made on the CPU whatever its group)."""
    import types

    import slimish.collectives
    from slimish.trainer import batch, losses

    if what == "microbatch":
        batch.MicroBatch.to = lambda self, device, non_blocking=False: self
    elif what == "factory":
        def zeros(*args, device=None, **kwargs):
            return torch.zeros(*args, **kwargs)

        losses.torch = types.SimpleNamespace(**{**vars(torch), "zeros": zeros})
    elif what == "collective":
        slimish.collectives.group_device = lambda group=None: torch.device("cpu")
    else:
        raise ValueError(f"--drop-device {what!r}: one of microbatch, factory, collective")


def as_on_cuda() -> None:
    """What `megatron_cpu.apply()` does beyond the device leaves Megatron-Core as it is on a CUDA machine, where
    `apply()` does nothing: moe_utils' Transformer-Engine names stay undefined (on the emulated GPU, the state of a GPU
    without Transformer Engine). Whatever else the trainer needs there must come from the trainer's own code."""
    from slimish.compat import megatron_cpu, megatron_te_absent

    apply = megatron_cpu.apply

    def apply_as_on_cuda() -> bool:
        patched = apply()
        import megatron.core.transformer.moe.moe_utils as moe_utils

        for name in megatron_te_absent.MOE_UTILS_TE_NAMES:
            if getattr(moe_utils, name, 0) is None:
                delattr(moe_utils, name)
        return patched

    megatron_cpu.apply = apply_as_on_cuda


def main() -> None:
    args = rank_args("out")
    if args.as_on_cuda:
        as_on_cuda()
    if args.drop_device:
        drop_device(args.drop_device)
    if args.whole_reads:
        from slimish.megatron_bridge import slice_read

        slice_read.read_local = lambda *a, **kw: (slice_read.read_whole(*a, **kw), False)
    worker = make_worker(args)
    device_bytes = {"setup": device_memory()}  # the emulated GPU's count (SLIMISH_EMULATED_GPU_MEMORY=1), else None
    samples = fixed_samples()
    before, rows = response_logprobs(worker, samples)
    ctx = worker.step
    batch, parity = rl_step.prepare(ctx, samples)  # engine logprobs are 0 here: |trainer logprobs| over the rollout
    if worker.cfg.trainer.loss.advantage_estimator == "grpo":
        estimator = given_advantages(ctx.estimator, [1.0, -1.0, -1.0, 1.0, 0.5, -0.5, 0.5, -0.5])
    else:  # the estimator's, from rewards: its step statistics span every data-parallel rank
        for sample, reward in zip(samples, [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]):
            sample.reward = reward
        estimator = None
    advantages = rl_step.advantages(ctx, batch, estimator)
    with count_calls(ctx.policy.chunks) as calls:
        metrics = rl_step.train(ctx, batch)
    del batch  # the step's micro-batches: what the device holds after a step is the roles' state
    device_bytes["after_step"] = device_memory()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    offloaded = offload_round_trip(worker, out) if args.offload else None
    after, _ = response_logprobs(worker, samples)
    state = export_state(worker)  # on the trainer's device
    from megatron.core import parallel_state as ps

    result = {"before": before, "after": after, "rows": rows, "metrics": metrics, "parity": parity,
              "advantages": advantages, "dp_rank": ctx.dp_rank, "dp_size": ctx.dp_size,
              "expert_sizes": {"etp": ps.get_expert_tensor_parallel_world_size(),
                               "ep": ps.get_expert_model_parallel_world_size(),
                               "edp": ps.get_expert_data_parallel_world_size()},
              "state": {name: tensor.cpu() for name, tensor in state.items()}, "offload": offloaded,
              "train_calls": dict(calls), "moments": moment_bytes(worker), "device_bytes": device_bytes,
              "weights_read": worker.weights_read}
    if args.more_steps:
        result.update(more_steps(worker, samples, state, out))
    torch.save(result, out / f"rank{args.rank}.pt")
    worker.shutdown()


def device_memory() -> int | None:
    """The bytes the emulated GPU holds now (`slimish.compat.emulated_gpu.memory_allocated`); None when not counted."""
    import gc

    from slimish.compat import emulated_gpu

    if not (emulated_gpu.enabled() and emulated_gpu.MEMORY.on):
        return None
    gc.collect()
    return emulated_gpu.memory_allocated()


@contextlib.contextmanager
def count_calls(chunks: list):
    """{submodule of a transformer layer ("self_attention.core_attention", "mlp", "input_layernorm", ...): its calls
    over every layer of the model `chunks`} while the block runs: activation recompute calls a recomputed module again
    in the backward pass."""
    import collections
    import re

    calls: collections.Counter = collections.Counter()
    handles = []
    for name, module in (item for chunk in chunks for item in chunk.named_modules()):
        match = re.search(r"\.layers\.\d+\.(.+)$", name)
        if match:
            def hook(*_args, key=match.group(1)):
                calls[key] += 1

            handles.append(module.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def moment_bytes(worker) -> dict[str, int]:
    """{"host": bytes, "device": bytes} of the policy optimizer's Adam moments (exp_avg, exp_avg_sq), by where they
    live: host memory where Megatron's CPU offload (trainer.optimizer.cpu_offload) keeps them."""
    from slimish.trainer.checkpoint import adams

    optimizer, found = worker.step.policy.optimizer, {"host": 0, "device": 0}
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for adam in adams(part):
            for state in adam.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        found["host" if state[key].device.type == "cpu" else "device"] += state[key].nbytes
    return found


def offload_round_trip(worker, out: Path) -> dict:
    """Every role's device memory to host memory and back, in a colocated step's order: optimizer state and
    gradients after training, the models after the weight sync (that reads them), a checkpoint saved while
    offloaded (to out/offloaded_checkpoint), then onload before the next step trains. What the roles held on the
    device before, after each offload, after the save and after onload; the calls' own figures, summed; and (with
    CUDA) the GPU memory allocated before, while offloaded and after."""
    allocated = [] if not torch.cuda.is_available() else [torch.cuda.memory_allocated()]
    held = [worker.device_bytes()]
    state = worker.offload(("state",))
    held.append(worker.device_bytes())
    params = worker.offload(("params",))
    held.append(worker.device_bytes())
    if allocated:
        allocated.append(torch.cuda.memory_allocated())
    worker.save_checkpoint(str(out / "offloaded_checkpoint"))
    held.append(worker.device_bytes())
    back = worker.onload()
    held.append(worker.device_bytes())
    if allocated:
        allocated.append(torch.cuda.memory_allocated())
    moved = {key: state[key] + params[key] for key in state}
    return {"held": held, "cuda_allocated": allocated, **moved, **back}


def more_steps(worker, samples, state: dict[str, torch.Tensor], out: Path) -> dict:
    """After the RL step: weight sync's flatten and expected checksums of the exported (device) tensors, and those
    of their CPU copies, for an engine of one rank and for one of two CPU ranks (slices, zero padding built beside
    the tensor); a checkpoint saved, an SFT step, the checkpoint loaded back and the logprobs then."""
    from slimish.weight_sync.buckets import FlatBuffers, plan_buckets
    from slimish.weight_sync.checksums import EngineSharding, ExpectedChecksums

    result = {}
    if state:  # rank 0
        flat_buffers, flat = FlatBuffers(), []
        for bucket in plan_buckets(state.items(), bucket_bytes=64 * 1024):
            flat.append(flat_buffers.flatten(bucket).cpu())
        result["flat"] = torch.cat(flat)
        cpu_state = {n: t.cpu() for n, t in state.items()}
        for suffix, sharding in (("", EngineSharding()), ("_tp2", EngineSharding(tp=2, cpu=True))):
            for key, tensors in (("checksums", state), ("cpu_checksums", cpu_state)):
                expected = ExpectedChecksums(worker.arch, getattr(torch, worker.cfg.model.dtype), sharding)
                for name, tensor in tensors.items():
                    expected.add(name, tensor)
                result[key + suffix] = expected.result()
        # A vocabulary of 70 rows on an engine of two ranks: rank 1's slice is 6 real rows and 26 rows of zeros
        # (padded to 64), made beside the tensor, on its device.
        for key, tensors in (("padded_checksums", state), ("cpu_padded_checksums", cpu_state)):
            expected = ExpectedChecksums(worker.arch, getattr(torch, worker.cfg.model.dtype), EngineSharding(tp=2))
            expected.add("model.embed_tokens.weight", tensors["model.embed_tokens.weight"][:70])
            result[key] = expected.result()
    worker.save_checkpoint(str(out / "checkpoint"))
    result["sft"] = worker.sft_step(samples)
    # The checkpoint saved while offloaded (--offload) holds what this one holds: load it, else this one.
    offloaded = out / "offloaded_checkpoint"
    worker.load_checkpoint(str(offloaded if offloaded.exists() else out / "checkpoint"))
    result["after_load"] = response_logprobs(worker, samples)[0]
    return result


if __name__ == "__main__":
    main()
