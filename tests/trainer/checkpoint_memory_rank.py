"""One rank of the checkpoint host-memory test, launched by tests.multiproc.run_world:
  python tests/trainer/checkpoint_memory_rank.py --rank R --world-size N --port P --tp T --hf DIR --data JSONL
      --format shards|fully_reshardable --ckpt CKPT --out OUT [--set trainer.optimizer.distributed=true]
Two GRPO steps (the Adam state exists), then a save to CKPT and a load of it into the same worker, each measured as
the rise of this process's resident-memory high-water mark over its resident size just before (VmHWM, reset via
/proc/self/clear_refs). --format fully_reshardable saves and loads in Megatron's format that slimish used before
`slimish.trainer.optimizer_shards`. Writes OUT/rank{R}.json: the two rises, the bytes of the fp32 main weights and
Adam moments of the whole stage and of this rank's shard, and (shards) how many parameters' loaded boxes were copied
rather than read in place.
"""

from __future__ import annotations

import gc
import json
import re
from pathlib import Path

STATE_BYTES_PER_PARAM = 12  # fp32 main weight, exp_avg, exp_avg_sq


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def measured(action) -> int:
    """Bytes the high-water mark of this process's RSS rose above its RSS while `action()` ran."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS
    before = _status("VmRSS")
    action()
    return _status("VmHWM") - before


def main() -> None:
    from slimish.trainer import checkpoint, optimizer_shards
    from tests.kit.trainer import rl_step
    from tests.trainer.checkpoint_rank import ADVANTAGES
    from tests.trainer.worker_rank import fixed_samples, make_worker, rank_args

    args = rank_args("format", "ckpt", "out")
    if args.format == "fully_reshardable":
        optimizer_shards.install = lambda part: None  # Megatron's own param_state, as slimish saved it before
    worker = make_worker(args)
    for _ in range(2):
        rl_step(worker, fixed_samples(), ADVANTAGES)
    policy = worker.step.policy
    stage = sum(p.numel() for chunk in policy.chunks for p in chunk.parameters())
    shard = sum(p.numel() for part in checkpoint._distributed_parts(policy.optimizer)
                for group in part.optimizer.param_groups for p in group["params"])
    result = {"stage_bytes": stage * STATE_BYTES_PER_PARAM, "shard_bytes": shard * STATE_BYTES_PER_PARAM,
              "save": measured(lambda: worker.save_checkpoint(args.ckpt)),
              "load": measured(lambda: worker.load_checkpoint(args.ckpt))}
    if args.format == "shards":  # parameters whose loaded boxes were copied rather than read in place
        result["copied"] = sum(part._slimish_copied for part in checkpoint._distributed_parts(policy.optimizer))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{args.rank}.json").write_text(json.dumps(result))
    worker.shutdown()


if __name__ == "__main__":
    main()
