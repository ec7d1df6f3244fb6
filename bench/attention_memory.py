"""Benchmark the trainer's core attention on long sequences: memory and time of one layer's forward and backward.

    python bench/attention_memory.py [--device cuda|cpu] [--tokens 2048,8192,32768] [--heads 32] [--kv-heads 8]
                                     [--head-dim 128] [--dtype bfloat16]

Two implementations, measured in the same run on the same inputs (one layer of a Qwen3-8B-shaped attention by
default: 32 query heads, 8 KV heads, head dim 128, bf16):
  local  trainer.attention=local: Megatron-Core's local `DotProductAttention` (the local layer spec), through
         slimish's packed wrapper (`slimish.compat.packed_attention`) for packed rows. It materialises the scores
         of every (query, key) pair of a sample, S x S per head, with an fp32 softmax and its saved copies;
  sdpa   trainer.attention=sdpa (auto without Transformer Engine): `slimish.trainer.attention.SdpaAttention`, torch's
         `scaled_dot_product_attention`, causal, per sample of a packed row with its bounds on the host (flash
         attention on a GPU: memory linear in S).
Two layouts for each number of tokens T: padded (one sample of T tokens) and packed (T tokens in four samples of
T/2, T/4, T/8, T/8, each attending causally to itself only).

For each: the peak memory allocated above the inputs during forward + backward (GiB), what stays allocated after the
outputs and gradients are dropped, the time of forward + backward (best of 3 after one warm-up; CUDA events), and for
`local` the peak per score element (bytes / (heads * sum of len^2)). A run that does not fit says "OOM". The two
implementations' outputs are compared at the smallest T (max abs difference). On the CPU (`--device cpu`, the
battery's dry run) the figures are RSS-free: only the numerics and that every part starts are checked.

Last line:
    sdpa_vs_local_peak_8k=<x> local_peak_gib_8k=<a> sdpa_peak_gib_8k=<b> local_bytes_per_score=<c> device=<d>
with x = sdpa's peak / local's peak for the padded layout at the T nearest 8k (inf where local ran out of memory).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def setup_megatron(device: str, port: int) -> None:
    """A one-rank Megatron world (NCCL on a GPU, gloo on the CPU), as the trainer makes it."""
    from slimish.network import free_port
    from slimish.trainer.parallel import ParallelLayout, init_parallel

    init_parallel(ParallelLayout(rank=0, world_size=1), master_addr="127.0.0.1", master_port=port or free_port(),
                  backend="nccl" if device == "cuda" else "gloo", seed=1234)


def local_attention(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str):
    """The trainer's core attention: the local spec's DotProductAttention with slimish's packed-row support."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from slimish.compat.packed_attention import packed

    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=kv_heads, kv_channels=head_dim, attention_dropout=0.0,
                               masked_softmax_fusion=False, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                               apply_rope_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False)
    module = packed(DotProductAttention)(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                         attention_type="self")
    return module.to(device)


def sdpa_attention(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str):
    """The trainer's SDPA core attention (`slimish.trainer.attention.SdpaAttention`), as its layer spec builds it."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from slimish.trainer.attention import SdpaAttention

    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=kv_heads, kv_channels=head_dim, attention_dropout=0.0,
                               bf16=dtype == torch.bfloat16, params_dtype=dtype)
    return SdpaAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self").to(device)


def run_local(module, q, k, v, lengths: list[int]):
    from megatron.core.packed_seq_params import PackedSeqParams

    if len(lengths) == 1:  # [s, b, heads, dim]; Megatron's causal mask for a None mask is built on CUDA: give it
        s = lengths[0]
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=q.device), 1)[None, None]
        return module(q[:, None], k[:, None], v[:, None], causal)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    return module(q, k, v, None, packed_seq_params=params)  # THD: [t, heads, dim], as the trainer passes it


def run_sdpa(module, q, k, v, lengths: list[int]):
    """[t, heads, dim] queries, [t, kv_heads, dim] keys and values -> [t, heads * dim]: causal per sample, as the
    trainer passes them (padded: [s, b=1, heads, dim]; packed: THD with the bounds on the host)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if len(lengths) == 1:
        return module(q[:, None], k[:, None], v[:, None], None)[:, 0]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    return module(q, k, v, None, packed_seq_params=params)


def measure(fn, q, k, v, device: str) -> dict:
    """Peak GiB above the inputs, GiB left after dropping outputs and grads, best seconds of fwd + bwd."""
    cuda = device == "cuda"
    times = []
    peak = kept = 0.0
    for attempt in range(4):
        for x in (q, k, v):
            x.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = fn()
        out.float().sum().backward()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
            peak = max(peak, (torch.cuda.max_memory_allocated() - base) / 2**30)
        else:
            elapsed = time.perf_counter() - t0
        del out
        for x in (q, k, v):
            x.grad = None
        if cuda:
            kept = (torch.cuda.memory_allocated() - base) / 2**30
        if attempt:
            times.append(elapsed)
    return {"peak_gib": peak, "kept_gib": kept, "seconds": min(times)}


def layouts(tokens: int) -> dict[str, list[int]]:
    """Sample lengths of the two layouts of `tokens` tokens."""
    packed = [tokens // 2, tokens // 4, tokens // 8]
    return {"padded": [tokens], "packed": [*packed, tokens - sum(packed)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tokens", default="2048,8192,32768")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    setup_megatron(args.device, args.port)
    module = local_attention(args.heads, args.kv_heads, args.head_dim, dtype, args.device)
    sdpa = sdpa_attention(args.heads, args.kv_heads, args.head_dim, dtype, args.device)
    results: dict[tuple[int, str, str], dict] = {}
    token_counts = [int(t) for t in args.tokens.split(",")]
    print(f"attention of {args.heads} heads ({args.kv_heads} KV), head dim {args.head_dim}, {args.dtype}, "
          f"on {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}; forward + backward of one layer")
    for tokens in token_counts:
        for layout, lengths in layouts(tokens).items():
            gen = torch.Generator(device="cpu").manual_seed(tokens)
            q, k, v = (torch.randn(tokens, h, args.head_dim, generator=gen, dtype=torch.float32).to(args.device, dtype)
                       .requires_grad_() for h in (args.heads, args.kv_heads, args.kv_heads))
            scores = args.heads * sum(n * n for n in lengths)
            calls = {"local": functools.partial(run_local, module, q, k, v, lengths),
                     "sdpa": functools.partial(run_sdpa, sdpa, q, k, v, lengths)}
            for name, fn in calls.items():
                try:
                    result = measure(fn, q, k, v, args.device)
                except torch.OutOfMemoryError:
                    result = {"oom": True}
                    torch.cuda.empty_cache()
                results[tokens, layout, name] = result
                line = (f"{tokens:>6} tokens {layout:>6} {name:>5}: OOM" if "oom" in result else
                        f"{tokens:>6} tokens {layout:>6} {name:>5}: peak {result['peak_gib']:8.3f} GiB  kept "
                        f"{result['kept_gib']:.3f} GiB  fwd+bwd {result['seconds'] * 1e3:9.2f} ms")
                if name == "local" and "oom" not in result and args.device == "cuda":
                    result["bytes_per_score"] = result["peak_gib"] * 2**30 / scores
                    line += f"  {result['bytes_per_score']:.1f} B/score"
                print(line, flush=True)
            if tokens == token_counts[0]:
                with torch.no_grad():
                    diff = (run_local(module, q, k, v, lengths).reshape(tokens, -1).float()
                            - run_sdpa(sdpa, q, k, v, lengths).float()).abs().max().item()
                print(f"{tokens:>6} tokens {layout:>6}: max |local - sdpa| = {diff:.2e}", flush=True)
            del q, k, v, calls
    near = min(token_counts, key=lambda t: abs(math.log(t / 8192)))
    local, sdpa = results[near, "padded", "local"], results[near, "padded", "sdpa"]
    ratio = (float("inf") if "oom" in local else
             sdpa.get("peak_gib", float("nan")) / local["peak_gib"] if local["peak_gib"] else float("nan"))
    per_score = next((r["bytes_per_score"] for r in results.values() if "bytes_per_score" in r), float("nan"))
    print(f"sdpa_vs_local_peak_8k={ratio:.4f} local_peak_gib_8k={local.get('peak_gib', float('inf')):.3f} "
          f"sdpa_peak_gib_8k={sdpa.get('peak_gib', float('inf')):.3f} local_bytes_per_score={per_score:.2f} "
          f"device={args.device}")


if __name__ == "__main__":
    main()
