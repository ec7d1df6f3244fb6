"""`slimish.weight_sync.tile_hash` is bit-equal to SGLang's GPU tensor hash: its Triton kernels run under the Triton
interpreter on the CPU (tests/weight_sync/triton_hash.py, one process for the file: ~16 s of the file's ~17 s), for
sizes around the 32-KiB tile, sizes not a multiple of 4 bytes, several dtypes, and the same tensors hashed from
byte ranges that split tiles and words, merged in any order (and pickled, as an owner sends them)."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimish.weight_sync.tile_hash import TILE_WORDS, TileHash, tile_hash

TILE = 4 * TILE_WORDS
SIZES = [1, 2, 3, 4, 5, 7, TILE - 3, TILE - 1, TILE, TILE + 1, TILE + 4, 2 * TILE + 2, 3 * TILE + 7, 70001]


def _cases() -> list[torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    out = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen, device="cpu") for n in SIZES]
    out += [torch.randn(5, 3001, generator=gen, device="cpu").to(dtype)
            for dtype in (torch.float32, torch.bfloat16, torch.float16)]
    out.append(torch.randint(-128, 127, (3, TILE + 1), dtype=torch.int8, generator=gen, device="cpu"))
    out.append(torch.randn(4, 2 * TILE // 4 + 3, generator=gen, device="cpu")[:, 1:])  # not contiguous
    out.append(torch.empty(0, dtype=torch.bfloat16, device="cpu"))
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list[torch.Tensor], list[str]]:
    """The test tensors and the kernel's hash of each."""
    tensors = _cases()
    folder = tmp_path_factory.mktemp("triton_hash")
    torch.save(tensors, folder / "in.pt")
    subprocess.run([sys.executable, str(Path(__file__).with_name("triton_hash.py")), str(folder / "in.pt"),
                    str(folder / "out.pt")], check=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    return tensors, [f"{h:016x}" for h in torch.load(folder / "out.pt")]


def test_whole_tensors_hash_as_sglangs_kernel(reference):
    tensors, expected = reference
    assert [tile_hash(t) for t in tensors] == expected


def test_ranges_hashed_apart_and_merged_hash_as_the_whole(reference):
    """Cuts at random bytes (through words and tiles), each range a state of its own, merged shuffled after a
    pickle round trip; and one state fed every range out of order."""
    rng = random.Random(1)
    tensors, expected = reference
    for tensor, want in zip(tensors, expected):
        data = tensor.contiguous().reshape(-1).view(torch.uint8)
        n = data.numel()
        if n < 2:
            continue
        cuts = sorted(rng.sample(range(1, n), min(6, n - 1)))
        if n > TILE + 8:
            cuts = sorted({*cuts, TILE - 1, TILE + 2})  # a word and a tile split at their edge
        bounds = [0, *cuts, n]
        ranges = list(zip(bounds, bounds[1:]))
        rng.shuffle(ranges)
        states = [pickle.loads(pickle.dumps(TileHash(total=n).add(data[s:e], s))) for s, e in ranges]
        merged = TileHash()
        for state in states:
            merged.merge(state)
        assert merged.finalize() == want, f"{n} bytes, ranges {ranges}"
        one = TileHash(total=n)
        for s, e in ranges:
            one.add(data[s:e], s)
        assert one.finalize() == want


def test_a_hash_missing_bytes_raises():
    state = TileHash(total=10).add(torch.zeros(6, dtype=torch.uint8, device="cpu"), 0)
    assert not state.complete
    with pytest.raises(ValueError, match="10 bytes given 6"):
        state.finalize()
