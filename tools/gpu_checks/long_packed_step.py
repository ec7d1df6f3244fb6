"""One RL step of the trainer on one long packed micro-batch, on the GPU: its peak memory and time (the GPU battery's
`long` part; tools/gpu_battery.sh).

    python tools/gpu_checks/long_packed_step.py [--tokens 32768] [--device cuda|cpu] [--attention auto]

A small Qwen3-shaped model (hidden 512, 4 layers, 8 query heads over 2 KV groups, head dim 64, bf16 on the GPU,
max_position_embeddings past the row) built here from random weights, one trainer rank (TrainerWorker, the job's own
code path: old logprobs, advantages, one optimizer step), trainer.max_tokens_per_micro_batch = --tokens and one
micro-batch of three samples of --tokens/2, /4 and /4 tokens back to back (the packed THD row: each sample attends
causally to itself only), logits --chunk tokens at a time. The step runs twice; the second is timed. On a GPU the
peak is `torch.cuda.max_memory_allocated` over the second step (the high-water mark reset before it); on the CPU
(the battery's dry run) only that it runs is checked.

Last line:
    long_packed_step tokens=<T> attention=<a> peak_gib=<p> step_s=<s> tokens_per_s=<r> device=<d>
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def samples(tokens: int, vocab: int):
    from slimish.sample import Sample, Status

    rng = random.Random(0)
    out = []
    for i, length in enumerate((tokens // 2, tokens // 4, tokens - tokens // 2 - tokens // 4)):
        prompt, response = 64, length - 64
        out.append(Sample(group_id=0, index=i, prompt="p", prompt_ids=[rng.randrange(vocab) for _ in range(prompt)],
                          response_ids=[rng.randrange(vocab) for _ in range(response)],
                          rollout_logprobs=[0.0] * response, weight_versions=[0] * response, loss_mask=[1] * response,
                          status=Status.COMPLETED))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--attention", default="auto", help="trainer.attention")
    parser.add_argument("--chunk", type=int, default=2048, help="trainer.logprob_chunk_tokens")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("long_packed_step: no CUDA device (run with --device cpu for the dry run)")
    from slimish.network import free_port
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model
    from slimish.trainer import rl_step
    from slimish.trainer.parallel import ParallelLayout, init_parallel
    from tests.kit.trainer import make_worker

    on_gpu = args.device == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", corpus=echo_digit.corpus(), hidden_size=512,
                                 intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                                 num_key_value_heads=2, head_dim=64, max_position_embeddings=args.tokens + 1024)
        data = echo_digit.write_datasets(Path(tmp) / "data")["train"]
        init_parallel(ParallelLayout(rank=0, world_size=1), master_addr="127.0.0.1", master_port=free_port(),
                      backend="nccl" if on_gpu else "gloo", seed=1)
        worker = make_worker(f"model.hf_path={model}", f"data.path={data}", f"trainer.attention={args.attention}",
                             f"trainer.max_tokens_per_micro_batch={args.tokens}",
                             f"trainer.logprob_chunk_tokens={args.chunk}",
                             f"model.dtype={'bfloat16' if on_gpu else 'float32'}")
        batch = samples(args.tokens, worker.arch.vocab_size)
        ctx = worker.step
        # Advantages +1, -1, +1 per sample: the step's work does not depend on their values.
        signs = dataclasses.replace(ctx.estimator, advantages=lambda inputs, _cfg: [
            torch.full_like(mask, (-1.0) ** i) for i, mask in zip(inputs.indices, inputs.masks)])
        seconds = peak = 0.0
        for _ in range(2):
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            step_batch, _ = rl_step.prepare(ctx, batch)
            rl_step.advantages(ctx, step_batch, signs)
            metrics = rl_step.train(ctx, step_batch)
            if on_gpu:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / 2**30
            seconds = time.perf_counter() - start
        micro_batches = len(rl_step.plan(ctx, batch, 1)[0][0])
        print(f"one step: {micro_batches} micro-batch(es), grad_norm {metrics['grad_norm']:.4f}, "
              f"pg_loss {metrics['pg_loss']:.4f}")
        print(f"long_packed_step tokens={args.tokens} attention={args.attention} peak_gib={peak:.2f} "
              f"step_s={seconds:.2f} tokens_per_s={args.tokens / seconds:.0f} device={args.device}")
        worker.shutdown()


if __name__ == "__main__":
    main()
