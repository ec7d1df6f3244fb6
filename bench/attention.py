"""Benchmark the trainer's core attention alone on the CPU: Megatron's local attention against `SdpaAttention`.

    python bench/attention.py [--tokens 2048,8192,32768] [--budget-gib 6] [--repeats 2]    (or: make bench-attention)

One layer's core attention (`trainer.attention`, `slimish.trainer.attention`), forward and backward down to its
query, key and value (the gradients the layer's projections would get), one causal row of s tokens (batch 1), fp32,
8 query heads in 2 KV groups (GQA), head dim 128:
  local  `trainer.attention=local`: Megatron-Core's `DotProductAttention` through slimish's wrapper
         (`slimish.compat.packed_attention`), given the row and no mask as the trainer's collation gives it (the
         wrapper builds the [s, s] causal mask). It holds [heads, s, s] fp32 scores, their softmax and, in the
         backward, their gradients;
  sdpa   `trainer.attention=sdpa`: `SdpaAttention`, torch's fused flash kernel on the CPU, memory linear in s.
fp32 because it is what the CPU trainer runs (configs/quickstart_cpu.yaml: model dtype float32), and the local
attention's softmax is fp32 in any dtype: bf16 would time this CPU's bf16 matmuls, not the attentions.

Each case runs in a fresh process (torch.set_num_threads(2)): one warm-up call at 256 tokens (thread pools, lazy
imports), the inputs, then the high-water mark reset (/proc/self/clear_refs) and --repeats calls. Peak = VmHWM minus
the RSS before the first call (what the call adds, gradients of q / k / v included); time per token = the fastest
call's seconds / s.

A case whose projected memory exceeds --budget-gib is not run: its line prints the projection and "skipped
(projected N GiB > budget)". The projection for local is 18 B per score element (heads x s x s; the measured local
cases print their own B/score beside it) plus the s x s mask; for sdpa 4x its inputs and output (gradients, flash
buffers). Local with 8 heads projects 9.1 GiB at 8k and 146 GiB at 32k: skipped at the default budget. So both
attentions are also measured with 4 query heads in 1 KV group (half the heads, the same 4:1 grouping; both
attentions' memory and time are about linear in the number of heads) at 2k and 8k.

Last line:
    sdpa_vs_local_peak_mib_8k=<x> sdpa_vs_local_time_per_token_8k=<y> sdpa_peak_mib_32k=<z> heads_8k=<h>
with x and y sdpa's figure over local's at the token count nearest 8k, at the most heads (h) at which local ran
there, and z sdpa's peak (MiB) at the token count nearest 32k with 8 heads.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from long_sequences import peak_mib, reset_peak, rss_mib  # this script's folder: run as `python bench/attention.py`

REPO = Path(__file__).resolve().parents[1]
HEAD_DIM = 128
SHAPES = [(8, 2), (4, 1)]  # (query heads, KV groups): the realistic shape, then half its heads (see the docstring)
REDUCED_MAX_TOKENS = 8192  # the half-head cases stop here: at 32k local projects 74 GiB even with 4 heads
# fp32 scores, their softmax (kept for the backward) and, in the backward, gradients of both. Measured (2026-11-29):
# 18.0-18.7 B at 2k tokens, where fixed allocations weigh more, 16.8 at 8k; the projection is a guard, not a figure.
LOCAL_BYTES_PER_SCORE = 18
SDPA_FACTOR = 4
WARMUP_TOKENS = 256


def projected_gib(impl: str, tokens: int, heads: int, groups: int) -> float:
    if impl == "local":
        return (heads * tokens * tokens * LOCAL_BYTES_PER_SCORE + 2 * tokens * tokens) / 2**30
    return SDPA_FACTOR * tokens * (2 * heads + 2 * groups) * HEAD_DIM * 4 / 2**30  # q, out, k, v


def child(args) -> dict:
    """One case: peak MiB the call adds and its best seconds."""
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from slimish.compat.packed_attention import packed
    from slimish.network import free_port
    from slimish.trainer.attention import SdpaAttention
    from slimish.trainer.parallel import ParallelLayout, init_parallel

    torch.set_num_threads(2)
    init_parallel(ParallelLayout(rank=0, world_size=1), master_addr="127.0.0.1", master_port=free_port(),
                  backend="gloo", seed=1234)
    config = TransformerConfig(num_layers=1, hidden_size=args.heads * HEAD_DIM, num_attention_heads=args.heads,
                               num_query_groups=args.groups, kv_channels=HEAD_DIM, attention_dropout=0.0,
                               masked_softmax_fusion=False)
    core = (packed(DotProductAttention) if args.impl == "local" else SdpaAttention)(
        config, 1, AttnMaskType.causal, "self")

    def inputs(tokens: int):
        gen = torch.Generator().manual_seed(tokens)
        return [torch.randn(tokens, 1, h, HEAD_DIM, generator=gen).requires_grad_()  # [s, b=1, heads, dim]
                for h in (args.heads, args.groups, args.groups)]

    def call(q, k, v) -> float:
        start = time.perf_counter()
        core(q, k, v, None).sum().backward()  # the output is freed before the call returns
        seconds = time.perf_counter() - start
        for x in (q, k, v):
            x.grad = None
        return seconds

    call(*inputs(WARMUP_TOKENS))
    q, k, v = inputs(args.tokens)
    reset_peak()
    before = rss_mib()
    times = [call(q, k, v) for _ in range(args.repeats)]
    return {"peak_mib": peak_mib() - before, "seconds": min(times)}


def run_child(impl: str, tokens: int, heads: int, groups: int, repeats: int) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, "--tokens", str(tokens), "--heads", str(heads), "--groups",
           str(groups), "--repeats", str(repeats)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if result.returncode:
        sys.exit(f"bench child {impl} {tokens} tokens {heads} heads failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2048,8192,32768", help="comma-separated sequence lengths")
    parser.add_argument("--budget-gib", type=float, default=6.0,
                        help="skip a case whose projected memory exceeds this (GiB)")
    parser.add_argument("--repeats", type=int, default=2, help="calls per case; the fastest is timed")
    parser.add_argument("--child", choices=["local", "sdpa"], help=argparse.SUPPRESS)
    parser.add_argument("--heads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--groups", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(REPO))
        args.impl, args.tokens = args.child, int(args.tokens)
        print(json.dumps(child(args)))
        return
    token_counts = [int(t) for t in args.tokens.split(",")]
    print(f"core attention, forward + backward, fp32, batch 1, head dim {HEAD_DIM}, 2 threads; "
          f"budget {args.budget_gib:g} GiB")
    print(f"{'case':<28} {'projected':>10} {'peak added':>11} {'time/token':>11}  note")
    results: dict[tuple[str, int, int], dict] = {}
    for heads, groups in SHAPES:
        for tokens in token_counts:
            if heads != SHAPES[0][0] and tokens > REDUCED_MAX_TOKENS:
                continue
            for impl in ("local", "sdpa"):
                name = f"{impl} {heads}h/{groups}kv {tokens} tokens"
                projected = projected_gib(impl, tokens, heads, groups)
                if projected > args.budget_gib:
                    print(f"{name:<28} {projected:>6.2f} GiB {'-':>11} {'-':>11}  "
                          f"skipped (projected {projected:.1f} GiB > budget)", flush=True)
                    continue
                r = results[impl, tokens, heads] = run_child(impl, tokens, heads, groups, args.repeats)
                note = (f"{r['peak_mib'] * 2**20 / (heads * tokens * tokens):.1f} B/score" if impl == "local"
                        else "")
                print(f"{name:<28} {projected:>6.2f} GiB {r['peak_mib']:>7.0f} MiB {r['seconds'] / tokens * 1e6:>8.1f} "
                      f"us  {note}".rstrip(), flush=True)
    near8k = min(token_counts, key=lambda t: abs(math.log(t / 8192)))
    near32k = min(token_counts, key=lambda t: abs(math.log(t / 32768)))
    heads8k = next((h for h, _ in SHAPES if ("local", near8k, h) in results and ("sdpa", near8k, h) in results), None)
    nan = {"peak_mib": math.nan, "seconds": math.nan}
    local = results.get(("local", near8k, heads8k), nan)
    sdpa = results.get(("sdpa", near8k, heads8k), nan)
    sdpa32k = results.get(("sdpa", near32k, SHAPES[0][0]), nan)
    print(f"sdpa_vs_local_peak_mib_8k={sdpa['peak_mib'] / local['peak_mib']:.4f} "
          f"sdpa_vs_local_time_per_token_8k={sdpa['seconds'] / local['seconds']:.3f} "
          f"sdpa_peak_mib_32k={sdpa32k['peak_mib']:.0f} heads_8k={heads8k}")


if __name__ == "__main__":
    main()
