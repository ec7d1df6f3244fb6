"""`slimish.weight_sync.tile_hash` against SGLang's hash kernel on a real GPU (`gpu_tensor_hash`, what
`mm_utils.tensor_hash` calls for `/weights_checker` on CUDA; the GPU battery carries that module alone): whole
tensors of several dtypes and sizes around the 32-KiB tile, a parameter large enough to be hashed in several chunks
(`CHUNK_WORDS`), and the same tensors from ranges hashed apart on the GPU and merged. On the CPU tier the same hash
is held to the kernel run under the Triton interpreter (tests/weight_sync/test_tile_hash.py). Skipped without CUDA
(the emulated GPU has no Triton)."""

from __future__ import annotations

import time

import pytest
import torch

from slimish.weight_sync.tile_hash import CHUNK_WORDS, TILE_WORDS, TileHash, tile_hash

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (SGLang's hash kernel)")

TILE = 4 * TILE_WORDS


def _kernel(tensor: torch.Tensor) -> str:
    from sglang.kernels.ops.memory.gpu_tensor_hash import gpu_tensor_hash

    return f"{gpu_tensor_hash(tensor):016x}"


def _tensors() -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen)
           for n in (1, 3, 5, TILE - 1, TILE, TILE + 2, 3 * TILE + 7)]
    out += [torch.randn(7, 3001, device="cuda", generator=gen).to(dtype)
            for dtype in (torch.float32, torch.bfloat16, torch.float16)]
    out.append(torch.randn(9 * CHUNK_WORDS // 4 + 5, 4, device="cuda", generator=gen).to(torch.bfloat16))
    return out


def test_whole_tensors_and_merged_ranges_hash_as_sglangs_kernel():
    for tensor in _tensors():
        want = _kernel(tensor)
        assert tile_hash(tensor) == want, (tensor.dtype, tuple(tensor.shape))
        data = tensor.reshape(-1).view(torch.uint8)
        n = data.numel()
        cuts = sorted({c for c in (1, n // 3 + 1, n // 2 + 3, TILE + 1) if 0 < c < n})
        bounds = [0, *cuts, n]
        merged = TileHash()
        for start, end in reversed(list(zip(bounds, bounds[1:]))):
            merged.merge(TileHash(total=n).add(data[start:end], start))
        assert merged.finalize() == want, (tensor.dtype, tuple(tensor.shape), bounds)


def test_the_hash_rate_on_a_gpu():
    """Not a bound: the rate, printed, against the kernel's on the same 1 GiB parameter (docs/weight-sync.md)."""
    tensor = torch.randn(2**29, device="cuda").to(torch.bfloat16)
    rates = {}
    for name, fn in (("kernel", _kernel), ("tile_hash", tile_hash)):
        fn(tensor)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(tensor)
        torch.cuda.synchronize()
        rates[name] = tensor.numel() * 2 / 2**30 / (time.perf_counter() - start)
    print(f"GiB/s: kernel {rates['kernel']:.1f}, tile_hash {rates['tile_hash']:.1f}, "
          f"ratio {rates['tile_hash'] / rates['kernel']:.3f}")
