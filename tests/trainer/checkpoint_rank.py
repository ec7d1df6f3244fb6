"""One rank of a checkpoint layout test, launched by tests.multiproc.run_world:
  python tests/trainer/checkpoint_rank.py --rank R --world-size N --port P --tp T [--pp P] --hf DIR --data JSONL
      --mode save|async|save_fully_reshardable|load --ckpt CKPT --out OUT
save: two GRPO steps, save_checkpoint(CKPT), one more step. async: the same with a background save whose writer
is held (`background_writes.before_write`) until that third step is over, then finished ("incomplete_during_step":
CKPT had no metadata.json then). save_fully_reshardable: save, the distributed optimizer's state in Megatron's
fully_reshardable format (as slimish wrote it before `slimish.trainer.optimizer_shards`). load: load_checkpoint(CKPT),
one step. Rank 0 writes OUT/rank0.pt: the whole-model export at the checkpoint ("at_save" / "at_load"), after the
next step ("after"), and that step's metrics.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

ADVANTAGES = [1.0, -1.0, -1.0, 1.0, 0.5, -0.5, 0.5, -0.5]


def main() -> None:
    from tests.kit.trainer import export_state, rl_step
    from tests.trainer.worker_rank import fixed_samples, make_worker, rank_args

    args = rank_args("mode", "ckpt", "out")
    worker = make_worker(args)

    def step() -> dict:
        return rl_step(worker, fixed_samples(), ADVANTAGES)

    def export() -> dict:  # host copies (on the emulated GPU too)
        return {name: tensor.cpu() for name, tensor in export_state(worker).items()}

    result = {}
    if args.mode == "save_fully_reshardable":  # as slimish saved a distributed optimizer before optimizer_shards
        from slimish.trainer import optimizer_shards

        optimizer_shards.install = lambda part: None
        args.mode = "save"
    if args.mode == "save":
        step()
        step()
        worker.save_checkpoint(args.ckpt)
        result["at_save"] = export()
    elif args.mode == "async":
        from slimish.trainer import background_writes

        step()
        step()
        held, release = os.pipe()
        background_writes.before_write = lambda: os.read(held, 1)  # in the (forked) writer: wait for the step
        worker.save_checkpoint(args.ckpt, background=True)
        result["at_save"] = export()
        result["metrics"] = step()  # while the writer waits
        result["after"] = export()
        result["incomplete_during_step"] = not (Path(args.ckpt) / "metadata.json").exists()
        os.write(release, b"x")
        result["finished"] = worker.finish_checkpoint()
    else:
        worker.load_checkpoint(args.ckpt)
        result["at_load"] = export()
    if args.mode != "async":
        result["metrics"] = step()
        result["after"] = export()
    if args.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result, out / "rank0.pt")
    worker.shutdown()


if __name__ == "__main__":
    main()
