"""Benchmark flattening buckets for a weight sync: into two reused buffers (`FlatBuffers`, what every sender does)
against a fresh buffer per bucket (what the senders did before), on the same tensors, measured in the same run.

    python bench/flatten.py [--model-mib 1024] [--bucket-mb 64] [--rounds 3]

The tensors are a dense Qwen3-like layer's shapes in fp32 (hidden 1024) repeated up to --model-mib, planned into
--bucket-mb buckets with the code a sync uses (`plan_buckets`); every bucket's buffer is written whole. Best of
--rounds, one thread (as the sender's flattening thread). The last line is
    flat_buffers_vs_fresh=<x> fresh_s=<s> reused_s=<r> model_mib=<m> buckets=<n>
with x = fresh time / reused time. Alone on the machine this is the flatten phase's floor; in a real sync on two
cores the sender's hashing thread and the engines compete with it (bench/weight_sync.py shows the phase there).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slimish.weight_sync.buckets import Bucket, FlatBuffers, plan_buckets  # noqa: E402

LAYER = {"self_attn.q_proj.weight": (1024, 1024), "self_attn.k_proj.weight": (512, 1024),
         "self_attn.v_proj.weight": (512, 1024), "self_attn.o_proj.weight": (1024, 1024),
         "mlp.gate_proj.weight": (3072, 1024), "mlp.up_proj.weight": (3072, 1024),
         "mlp.down_proj.weight": (1024, 3072), "input_layernorm.weight": (1024,)}


def model_tensors(model_mib: float) -> list[tuple[str, torch.Tensor]]:
    tensors, nbytes, layer = [], 0, 0
    while nbytes < model_mib * 2**20:
        for name, shape in LAYER.items():
            tensor = torch.randn(shape)
            tensors.append((f"model.layers.{layer}.{name}", tensor))
            nbytes += tensor.numel() * tensor.element_size()
        layer += 1
    return tensors


def flatten_fresh(bucket: Bucket) -> torch.Tensor:
    return torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for t in bucket.tensors])


def best_seconds(flatten, buckets: list[Bucket], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for bucket in buckets:
            flatten(bucket)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-mib", type=float, default=1024.0)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tensors = model_tensors(args.model_mib)
    buckets = list(plan_buckets(tensors, int(args.bucket_mb * 2**20)))
    model_mib = sum(b.nbytes for b in buckets) / 2**20
    fresh_s = best_seconds(flatten_fresh, buckets, args.rounds)
    print(f"fresh buffer per bucket: {fresh_s:.3f}s ({model_mib / 1024 / fresh_s:.2f} GiB/s)", flush=True)
    reused_s = best_seconds(FlatBuffers().flatten, buckets, args.rounds)
    print(f"two reused buffers:      {reused_s:.3f}s ({model_mib / 1024 / reused_s:.2f} GiB/s)", flush=True)
    print(f"flat_buffers_vs_fresh={fresh_s / reused_s:.2f} fresh_s={fresh_s:.3f} reused_s={reused_s:.3f} "
          f"model_mib={model_mib:.0f} buckets={len(buckets)}", flush=True)


if __name__ == "__main__":
    main()
