"""One rank of a checkpoint layout test, launched by tests.multiproc.run_world:
  python tests/trainer/checkpoint_rank.py --rank R --world-size N --port P --tp T [--pp P] --hf DIR --data JSONL
      --mode save|load --ckpt CKPT --out OUT
save: two GRPO steps, save_checkpoint(CKPT), one more step. load: load_checkpoint(CKPT), one step. Rank 0 writes
OUT/rank0.pt: the whole-model export at the checkpoint ("at_save" / "at_load"), after the next step ("after"), and
that step's metrics.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from slimish.config import load_config

REPO = Path(__file__).resolve().parents[2]
ADVANTAGES = [1.0, -1.0, -1.0, 1.0, 0.5, -0.5, 0.5, -0.5]


def main() -> None:
    from tests.trainer.worker_rank import fixed_samples

    parser = argparse.ArgumentParser()
    for name in ("rank", "world-size", "port", "tp"):
        parser.add_argument(f"--{name}", type=int, required=True)
    for name in ("hf", "data", "mode", "ckpt", "out"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--pp", type=int, default=1)
    args = parser.parse_args()
    from slimish.trainer.worker import TrainerWorker

    cfg = load_config(REPO / "configs/quickstart_cpu.yaml", [
        f"model.hf_path={args.hf}", f"data.path={args.data}", "sft.steps=0", "trainer.micro_batch_size=2",
        "trainer.optimizer.lr=0.01", "trainer.loss.kl_coef=0.1", f"parallel.tensor_parallel={args.tp}",
        f"parallel.pipeline_parallel={args.pp}", f"parallel.num_trainer_ranks={args.world_size}"])
    worker = TrainerWorker(cfg, rank=args.rank, world_size=args.world_size)
    worker.setup(master_addr="127.0.0.1", master_port=args.port)

    def step() -> dict:
        worker.compute_logprobs(fixed_samples())
        return worker.train(ADVANTAGES)

    result = {}
    if args.mode == "save":
        step()
        step()
        worker.save_checkpoint(args.ckpt)
        result["at_save"] = worker.export_state()
    else:
        worker.load_checkpoint(args.ckpt)
        result["at_load"] = worker.export_state()
    result["metrics"] = step()
    result["after"] = worker.export_state()
    if args.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result, out / "rank0.pt")
    worker.shutdown()


if __name__ == "__main__":
    main()
