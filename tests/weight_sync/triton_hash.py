"""SGLang's GPU tensor hash (`sglang.kernels.ops.memory.gpu_tensor_hash`) computed by its own Triton kernels under
the Triton interpreter on the CPU: the reference tests/weight_sync/test_tile_hash.py holds `slimish.weight_sync.
tile_hash` to. `gpu_tensor_hash` itself asserts CUDA, so its two kernels are launched here as it launches them
(its defaults: 8192-word tiles, 256-word blocks, 1024-partial reduce chunks, its seed).

  TRITON_INTERPRET=1 python tests/weight_sync/triton_hash.py IN.pt OUT.pt
IN.pt: a list of tensors; OUT.pt: their hashes as ints. TRITON_INTERPRET must be set before triton is imported,
hence a process of its own.
"""

from __future__ import annotations

import os
import sys

import torch


def kernel_hash(tensor: torch.Tensor) -> int:
    import triton
    from sglang.kernels.ops.memory import gpu_tensor_hash as kernels

    data = tensor.contiguous().reshape(-1).view(torch.uint8)
    pad = (4 - (data.numel() & 3)) & 3
    if pad:  # as its _as_uint32_words pads
        data = torch.cat([data, torch.zeros(pad, dtype=torch.uint8, device="cpu")])
    words = data.view(torch.uint32)
    n = words.numel()
    if n == 0:
        return 0
    seed = 0x243F6A88
    grid = (triton.cdiv(n, 8192),)
    partials = torch.empty(grid[0], dtype=torch.uint64, device="cpu")
    kernels.hash_tiles32_kernel_blocked[grid](
        words, partials, n, seed1=seed & 0xFFFFFFFF, seed2=((seed * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF,
        FM_C1=kernels.FMIX32_C1, FM_C2=kernels.FMIX32_C2, POS_A=kernels.POS_C1, POS_B=kernels.POS_C2,
        TILE=8192, BLOCK=256, USE_CG=False)
    current = partials
    while current.numel() > 1:
        size = current.numel()
        following = torch.empty(triton.cdiv(size, 1024), dtype=torch.uint64, device="cpu")
        kernels.add_tree_reduce_u64_kernel[(following.numel(),)](current, following, size, CHUNK=1024)
        current = following
    return kernels._final_splitmix64(int(current.item()))


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 (before triton is imported)"
    tensors = torch.load(sys.argv[1])
    torch.save([kernel_hash(t) for t in tensors], sys.argv[2])


if __name__ == "__main__":
    main()
