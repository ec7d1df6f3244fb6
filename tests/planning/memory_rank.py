"""One rank of `test_activations.py`: a training step of long packed samples on the emulated GPU, its bytes counted.

Launched by tests.multiproc.run_world:
  python tests/planning/memory_rank.py --rank R --world-size N --port P --tp T --hf DIR --data JSONL --tokens N
      --out OUT [--set KEY=VALUE ...]
Runs one RL step (it makes Adam's moments), then a second with the emulated GPU's peak reset before it, and writes
OUT/rank{R}.json: the bytes held before the second step ("held": the roles' state), its peak ("peak") and the bytes
held after it ("after"), as `torch.cuda.memory_allocated` / `max_memory_allocated` count them
(`slimish.compat.emulated_gpu`, SLIMISH_EMULATED_GPU_MEMORY=1).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
from pathlib import Path

import torch

from slimish.sample import Sample, Status
from slimish.trainer import rl_step
from tests.kit.trainer import make_worker

PROMPT = 64  # prompt tokens of every sample (the plan's prompt_tokens)


def samples(tokens: int, vocab: int) -> list[Sample]:
    """Two random samples of tokens / 2 each: one packed micro-batch of `tokens` tokens."""
    rng = random.Random(0)
    length = tokens // 2 - PROMPT
    return [Sample(group_id=0, index=i, prompt="p", prompt_ids=[rng.randrange(vocab) for _ in range(PROMPT)],
                   response_ids=[rng.randrange(vocab) for _ in range(length)], rollout_logprobs=[0.0] * length,
                   weight_versions=[0] * length, loss_mask=[1] * length, status=Status.COMPLETED) for i in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("rank", "world-size", "port", "tp", "tokens"):
        parser.add_argument(f"--{name}", type=int, required=True)
    for name in ("hf", "data", "out"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    from slimish.compat import emulated_gpu

    worker = make_worker(*overrides(args.hf, args.data, tokens=args.tokens, tp=args.tp, world=args.world_size),
                         *args.set, rank=args.rank, world_size=args.world_size, master_port=args.port)
    ctx = worker.step
    batch = samples(args.tokens, worker.arch.vocab_size)
    # Advantages +1 / -1 by sample: a step with a real gradient whatever the rewards.
    signs = dataclasses.replace(ctx.estimator, advantages=lambda inputs, _cfg: [
        torch.full_like(mask, (-1.0) ** i) for i, mask in zip(inputs.indices, inputs.masks)])

    def step() -> None:
        prepared, _ = rl_step.prepare(ctx, batch)
        rl_step.advantages(ctx, prepared, signs)
        rl_step.train(ctx, prepared)

    step()
    gc.collect()
    held = emulated_gpu.memory_allocated()
    emulated_gpu.reset_peak_memory_stats()
    step()
    peak = emulated_gpu.max_memory_allocated()
    gc.collect()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{args.rank}.json").write_text(json.dumps(
        {"held": held, "peak": peak, "after": emulated_gpu.memory_allocated()}))
    worker.shutdown()


def overrides(hf: str, data: str, *, tokens: int, tp: int, world: int) -> list[str]:
    """The config of every layout: one packed micro-batch of `tokens` tokens, fp32, the SDPA attention, no reference
    model (kl_coef 0)."""
    return [f"model.hf_path={hf}", f"data.path={data}", f"trainer.max_tokens_per_micro_batch={tokens}",
            "trainer.logprob_chunk_tokens=512", f"rollout.max_new_tokens={tokens // 2 - PROMPT}",
            "trainer.attention=sdpa", "trainer.loss.kl_coef=0", f"parallel.tensor_parallel={tp}",
            f"parallel.num_trainer_ranks={world}"]


if __name__ == "__main__":
    main()
