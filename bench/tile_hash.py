"""The tile hash (`slimish.weight_sync.tile_hash`, a CUDA engine's checksum in torch) against SHA-256 (a CPU
engine's, hashlib), on one tensor, one thread: the rate of each, best of --rounds. With --device cuda, against
SGLang's own kernel on the GPU instead (`gpu_tensor_hash`).

  python bench/tile_hash.py [--mib 32] [--rounds 3] [--device cpu|cuda]
Last line: tile_vs_baseline=<tile rate / baseline rate> and both rates in MiB/s.
"""

from __future__ import annotations

import argparse
import time

import torch

from slimish.weight_sync.tile_hash import TileHash, tile_hash


def best_rate(fn, tensor: torch.Tensor, rounds: int) -> float:
    """MiB/s of `fn(tensor)`, the best of `rounds` after one warm-up."""
    fn(tensor)
    best = float("inf")
    for _ in range(rounds):
        if tensor.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(tensor)
        if tensor.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return tensor.numel() * tensor.element_size() / 2**20 / best


def sha256(tensor: torch.Tensor) -> str:
    from slimish.weight_sync.checksums import _Sha

    return _Sha(tensor.dtype).update(tensor).hexdigest()


def kernel(tensor: torch.Tensor) -> str:
    from sglang.kernels.ops.memory.gpu_tensor_hash import gpu_tensor_hash

    return f"{gpu_tensor_hash(tensor):016x}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    tensor = torch.randn(args.mib * 2**20 // 4, device=args.device)
    baseline_name, baseline = ("kernel", kernel) if args.device == "cuda" else ("sha256", sha256)
    # Two halves hashed apart and merged: what an owner's partial and rank 0's merge cost beyond the whole.
    half = tensor.numel() // 2

    def halves(t: torch.Tensor) -> str:
        nbytes = t.numel() * 4
        return TileHash(total=nbytes).add(t[:half], 0).merge(TileHash(total=nbytes).add(t[half:], half * 4)).finalize()

    assert halves(tensor) == tile_hash(tensor)
    rates = {"tile": best_rate(tile_hash, tensor, args.rounds), "tile_halves": best_rate(halves, tensor, args.rounds),
             baseline_name: best_rate(baseline, tensor, args.rounds)}
    for name, rate in rates.items():
        print(f"{name:>12}: {rate:.0f} MiB/s", flush=True)
    print(f"tile_vs_baseline={rates['tile'] / rates[baseline_name]:.3f} tile_mib_s={rates['tile']:.0f} "
          f"halves_mib_s={rates['tile_halves']:.0f} {baseline_name}_mib_s={rates[baseline_name]:.0f} "
          f"device={args.device} mib={args.mib}", flush=True)


if __name__ == "__main__":
    main()
