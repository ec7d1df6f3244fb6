"""One rank of a multi-process TrainerWorker test: the same fixed rollout at a given layout.

Launched by tests.multiproc.run_world:
  python tests/trainer/worker_rank.py --rank R --world-size N --port P --tp T [--pp P] [--dtype D] --hf DIR
      --data JSONL --out OUT
Writes OUT/rank{R}.pt with the response logprobs before and after one GRPO step with a KL penalty (None on a
pipeline stage other than the last), the step's advantages (fixed ones, or the configured estimator's from fixed
rewards) and metrics, the parity metrics of compute_logprobs, and the
whole-model export (`export_state`; empty except on rank 0).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from slimish.config import load_config
from slimish.sample import Sample, Status

REPO = Path(__file__).resolve().parents[2]


def fixed_samples() -> list[Sample]:
    """8 samples in 2 groups; responses and advantages fixed so every layout sees the same step. Prompts of 2 or 3
    tokens make consecutive micro-batches (of 2) differ in length, as pipeline stages must cope with."""
    return [Sample(group_id=i // 4, index=i % 4, prompt="say 7", prompt_ids=[269, 221, 23 + i % 3][:2 + i // 2 % 2],
                   response_ids=[23 + i % 2, 0], rollout_logprobs=[0.0, 0.0], weight_versions=[0, 0],
                   loss_mask=[1, 1], status=Status.COMPLETED) for i in range(8)]


def response_logprobs(worker, samples) -> tuple[torch.Tensor | None, list[int]]:
    """[samples of this rank, response length]: the trainer's logprobs of each response (equal lengths; None where
    there are none: a pipeline stage other than the last), and which of `samples` they are, in that order."""
    worker.compute_logprobs(samples)
    rows = worker.rollout_indices
    out = []
    for (_, mbs), old in zip(worker._rollout["plan"], worker._rollout["old"]):
        for mb, lp in zip(mbs, old):
            for row, (start, end) in zip(mb.rows, mb.spans):
                out.append(lp[row, start:end])
    worker._rollout = None
    return (torch.stack(out) if out else None), rows


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
    return parser.parse_args()


def make_worker(args: argparse.Namespace):
    """A set-up TrainerWorker for this rank of the layout in `args` (quickstart config, small micro-batches, a KL
    penalty so that the reference model runs)."""
    from slimish.trainer.worker import TrainerWorker

    cfg = load_config(REPO / "configs/quickstart_cpu.yaml", [
        f"model.hf_path={args.hf}", f"data.path={args.data}", "eval.every=0", "sft.steps=0",
        "trainer.micro_batch_size=2",
        "trainer.optimizer.lr=0.01", "trainer.loss.kl_coef=0.1", f"parallel.tensor_parallel={args.tp}",
        f"parallel.pipeline_parallel={args.pp}", f"parallel.num_trainer_ranks={args.world_size}",
        f"model.dtype={args.dtype}", *args.set])
    worker = TrainerWorker(cfg, rank=args.rank, world_size=args.world_size)
    worker.setup(master_addr="127.0.0.1", master_port=args.port)
    return worker


def main() -> None:
    args = rank_args("out")
    worker = make_worker(args)
    samples = fixed_samples()
    before, rows = response_logprobs(worker, samples)
    parity = worker.compute_logprobs(samples)  # engine logprobs are 0 here: |trainer logprobs| over the rollout
    if worker.cfg.trainer.loss.advantage_estimator == "grpo":
        advantages = worker.compute_advantages([1.0, -1.0, -1.0, 1.0, 0.5, -0.5, 0.5, -0.5])
    else:  # the estimator's, from rewards: its step statistics span every data-parallel rank
        for sample, reward in zip(samples, [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]):
            sample.reward = reward
        advantages = worker.compute_advantages()
    metrics = worker.train()
    after, _ = response_logprobs(worker, samples)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"before": before, "after": after, "rows": rows, "metrics": metrics, "parity": parity,
                "advantages": advantages,
                "dp_rank": worker.dp_rank, "dp_size": worker.dp_size, "state": worker.export_state()},
               out / f"rank{args.rank}.pt")
    worker.shutdown()


if __name__ == "__main__":
    main()
