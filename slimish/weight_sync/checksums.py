"""What each engine parameter's checksum must be after a sync, on every tensor-parallel rank of an engine, computed
on the sender from the tensors it sends.

SGLang's `/weights_checker` (action "checksum") reports, per tensor-parallel rank of an engine, a checksum of every
parameter that rank holds under SGLang's own names. Which bytes those are (the fused q/k/v and gate/up, experts,
padding, key/value-head replication, MLA's splits) is `slimish.weight_sync.sharding`'s rule, the same one the
sharded sync cuts each rank's payload by: `ExpectedChecksums.add` hashes an HF tensor's per-rank slices
(`EngineLayout.pieces`) in part order as the tensors stream past, without building the fused tensors, and
`add_shard` hashes a rank's whole engine parameter as the sharded sync sends it (`EngineShards`).

The hash is SGLang's own (`sglang.srt.managers.mm_utils.tensor_hash`), which depends on the engine's device
(`hash_kind`, from the engines' /server_info):
- SHA256, CPU engines: the first 8 bytes of the SHA-256 of the tensor's bytes, reproduced here (tests compare it
  with SGLang's function). A fused parameter is hashed part by part in part order; SHA-256 cannot be combined from
  parts hashed apart, so every part of one engine parameter must pass through one `ExpectedChecksums`.
- TILE, CUDA engines: SGLang's Triton kernel, reproduced in torch by `slimish.weight_sync.tile_hash`, which sums
  per-tile shares: each part is hashed at its byte offset as it arrives, on its own device, in any order (no fused
  tensor is built: on a GPU this saves a copy of the largest fused parameter, the stacked experts of a layer), and
  a sender holding only some expert slots of an engine parameter reports its partial (a `TileHash`), which rank 0
  combines with the other senders' (`merged`: the expert owners' route, `slimish.weight_sync.owners`).
- None (engines that do not say their device, as test stand-ins): by the tensors' device, as before: SHA-256 on
  the CPU, the kernel on CUDA (`_device_hash`; on the emulated GPU of the test tier, SHA-256 as a stand-in).

Covered (`layout_supported`): the dense and MoE families (llama, qwen2, qwen3, qwen3_moe, glm4_moe) on engines of
any tensor- and expert-parallel size SGLang accepts, except CPU engines whose size does not divide the attention
heads (SGLang then pads heads, not predicted here), and DeepSeek-V3's multi-latent attention (MLA: the down
projections whole on every rank, fused when there is a query LoRA; the up projections split by heads; `w_kc` /
`w_vc`, derived from `kv_b_proj` after loading, are not parameters and not reported). Not covered: engines with DP
attention (`rollout.engine.attention_data_parallel`); for those the sync checks that every engine reports the same
checksums as the first one, and the new weight version.
tests/weight_sync/test_engine_sharding.py pins these rules against SGLang's own loaders.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from slimish.megatron_bridge.hf_config import Architecture
from slimish.weight_sync.engine_loader import parse_slot

# The sharding rule lives in slimish.weight_sync.sharding; its names stay importable from here.
from slimish.weight_sync.sharding import (  # noqa: F401
    CPU_INTERMEDIATE_PADDING,
    VOCAB_PADDING,
    VOCAB_TENSORS,
    EngineLayout,
    EngineSharding,
    fuses_shared_experts,
    layout_supported,
    sharding_of,
)
from slimish.weight_sync.tile_hash import TileHash, tile_hash

SHA256, TILE = "sha256", "tile"


def hash_kind(sharding: EngineSharding) -> str | None:
    """The checksum engines sharded as `sharding` report: TILE on CUDA, SHA256 on the CPU, None where their
    /server_info does not say their device (then by the tensors' device, as `tensor_checksum`)."""
    return TILE if sharding.device == "cuda" else SHA256 if sharding.device == "cpu" else None


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's checksum of one tensor, as `/weights_checker` prints it."""
    if _on_device(tensor):
        return _device_hash(tensor.contiguous())
    return _Sha(tensor.dtype).update(tensor).hexdigest()


def _on_device(tensor: torch.Tensor) -> bool:
    return tensor.device.type != "cpu"


def _device_hash(tensor: torch.Tensor) -> str:
    """SGLang's hash of a tensor on a GPU (its Triton kernel). On the emulated GPU of the test tier, where no kernel
    runs, the stand-in at exactly this call is the hash of the same bytes on the CPU (what CPU engines report)."""
    if tensor.is_cuda:
        from sglang.kernels.ops.memory.gpu_tensor_hash import gpu_tensor_hash

        return f"{gpu_tensor_hash(tensor):016x}"
    return _Sha(tensor.dtype).update(tensor).hexdigest()


class _Sha:
    def __init__(self, dtype: torch.dtype):
        self.dtype, self._sha = dtype, hashlib.sha256()

    def update(self, tensor: torch.Tensor) -> _Sha:
        tensor = tensor.detach().to(dtype=self.dtype, device="cpu").contiguous()
        self._sha.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        return self

    def hexdigest(self) -> str:
        return f"{int.from_bytes(self._sha.digest()[:8], 'big'):016x}"


@dataclass
class _Fused:
    """An engine parameter on one rank made of `num_parts` slices, hashed in part order as they arrive."""
    num_parts: int
    hasher: _Sha | TileHash
    next_part: int = 0
    offset: int = 0  # tile hash: the byte offset of the next part
    waiting: dict[int, torch.Tensor] = field(default_factory=dict)
    parts: list[torch.Tensor] = field(default_factory=list)  # on a GPU (not for the tile hash): the fused tensor


class ExpectedChecksums:
    """Feed every HF tensor of a sync (`add`); `result()` is then, per tensor-parallel rank of an engine sharded as
    `sharding` and holding `dtype` weights, {engine parameter name: checksum}.

    `kind`: SHA256 or TILE; by default what `sharding` says the engines report (`hash_kind`: TILE for engines on
    CUDA, SHA256 on the CPU, else by the tensors' device; see the module docstring). With TILE, an engine
    parameter of expert slots of which only some were added is, in `result()`, its `TileHash` partial, for `merged`
    to combine. With TILE no fused tensor is built: each part is hashed where it lies, at its offset (on a GPU this
    saves a copy of the largest fused parameter, a layer's stacked experts on the rank, that the kernel would need).

    CPU tensors are hashed on a thread of their own (SHA-256 and torch's kernels release the GIL), in the order
    they were added, so hashing overlaps the transfer instead of lengthening it; a tensor is held until it is
    hashed. Tensors on a GPU are hashed where they are added."""

    def __init__(self, arch: Architecture, dtype: torch.dtype, sharding: EngineSharding = EngineSharding(),
                 kind: str | None = None):
        if not layout_supported(arch, sharding):
            raise ValueError(f"ExpectedChecksums does not know SGLang's parameters of this model on engines sharded "
                             f"as {sharding} (layout_supported)")
        if kind not in (SHA256, TILE, None):
            raise ValueError(f"ExpectedChecksums: kind {kind!r} is not one of {SHA256!r}, {TILE!r} or None")
        self.arch, self.dtype, self.sharding = arch, dtype, sharding
        self.kind = kind if kind is not None else hash_kind(sharding)
        self._slots: dict[tuple[int, str], list] = {}  # tile hash: (rank, parameter) -> [TileHash, slots added]
        self.layout = EngineLayout(arch, sharding)
        self._fused: dict[tuple[int, str], _Fused] = {}
        self._done: list[dict[str, str | Future]] = [{} for _ in range(sharding.tp)]
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="checksums")  # one thread: hashes in order

    def add(self, hf_name: str, tensor: torch.Tensor) -> None:
        """An HF tensor of the sync (the full path: every rank's slices of it)."""
        for rank, engine_name, part, num_parts, piece in self.layout.pieces(hf_name, tensor):
            self._add_piece(rank, engine_name, part, num_parts, piece)

    def add_shard(self, rank: int, engine_name: str, tensor: torch.Tensor) -> None:
        """Rank `rank`'s whole engine parameter `engine_name`, or one expert slot of it (`engine_loader.slot_name`,
        hashed as a part of the stacked parameter, in slot order), as the sharded sync sends it (`EngineShards`)."""
        param, slot = parse_slot(engine_name)
        if slot is None:
            self._add_piece(rank, engine_name, 0, 1, tensor)
        elif self.kind == TILE:
            self._add_slot(rank, param, slot, self.layout.experts_per_rank(param), tensor)
        else:
            self._add_piece(rank, param, slot, self.layout.experts_per_rank(param), tensor)

    def _run(self, fn, *args) -> str | Future | None:
        """`fn(*args)` here for tensors on a GPU, else on the hashing thread (`args[0]`: the tensor)."""
        return fn(*args) if _on_device(args[0]) else self._hasher.submit(fn, *args)

    def _add_slot(self, rank: int, param: str, slot: int, num_slots: int, piece: torch.Tensor) -> None:
        """Tile hash: expert slot `slot` of `num_slots` equal ones, hashed at its own offset in any order."""
        nbytes = piece.numel() * self.dtype.itemsize
        entry = self._slots.setdefault((rank, param), [TileHash(total=num_slots * nbytes), 0])
        self._run(_add_as, piece, entry[0], slot * nbytes, self.dtype)
        entry[1] += 1
        if entry[1] == num_slots:
            del self._slots[(rank, param)]
            self._done[rank][param] = self._hasher.submit(entry[0].finalize)  # after its adds on the thread

    def _add_piece(self, rank: int, engine_name: str, part: int, num_parts: int, piece: torch.Tensor) -> None:
        done = self._done[rank]
        if num_parts == 1:
            done[engine_name] = self._run(self._checksum, piece)
            return
        hasher = TileHash() if self.kind == TILE else _Sha(self.dtype)
        fused = self._fused.setdefault((rank, engine_name), _Fused(num_parts, hasher))
        fused.waiting[part] = piece
        while fused.next_part in fused.waiting:  # hash in part order; later parts wait for earlier ones
            piece = fused.waiting.pop(fused.next_part)
            if self.kind == TILE:  # at its offset, on its own device: no fused tensor
                self._run(_add_as, piece, fused.hasher, fused.offset, self.dtype)
                fused.offset += piece.numel() * self.dtype.itemsize
            elif _on_device(piece):
                fused.parts.append(piece.to(self.dtype))
            else:
                self._hasher.submit(fused.hasher.update, piece)
            fused.next_part += 1
        if fused.next_part == fused.num_parts:
            del self._fused[(rank, engine_name)]
            done[engine_name] = (self._checksum(torch.cat([p.reshape(-1) for p in fused.parts])) if fused.parts else
                                 self._hasher.submit(fused.hasher.finalize if self.kind == TILE else
                                                     fused.hasher.hexdigest))

    def _checksum(self, tensor: torch.Tensor) -> str:
        """One whole engine parameter's checksum, as the engines hash it."""
        tensor = tensor.to(self.dtype)
        if self.kind == TILE:  # SGLang's own kernel where it runs (faster, and the same value: tile_hash's tests)
            return _device_hash(tensor) if tensor.is_cuda else tile_hash(tensor)
        if self.kind == SHA256:
            return _Sha(self.dtype).update(tensor).hexdigest()
        return tensor_checksum(tensor)

    def result(self) -> list[dict[str, str | TileHash]]:
        """The checksums, per tensor-parallel rank; raises if an engine parameter got only some of its parts (the
        export missed a tensor), but for the tile hash's expert slots: those are the parameter's `TileHash`, whose
        other slots another sender hashed (`merged`)."""
        self._hasher.shutdown(wait=True)
        for (rank, param), (state, _) in self._slots.items():
            self._done[rank][param] = state
        self._slots = {}
        if self._fused:
            missing = {(f"{name} (rank {rank})" if self.sharding.tp > 1 else name):
                       f"{f.next_part + len(f.waiting)}/{f.num_parts} parts"
                       for (rank, name), f in self._fused.items()}
            raise RuntimeError(f"the sync sent only some parts of these engine parameters: {missing}")
        return [{name: value.result() if isinstance(value, Future) else value for name, value in done.items()}
                for done in self._done]

def _add_as(piece: torch.Tensor, state: TileHash, offset: int, dtype: torch.dtype) -> None:
    state.add(piece.to(dtype), offset)


def merged(own: list[dict[str, str | TileHash]], others: Iterable[list[dict[str, str | TileHash]]]
           ) -> list[dict[str, str]]:
    """Per tensor-parallel rank, the checksums of a sync from several senders (rank 0's `own` `result()`, and each
    pipeline stage's or expert owner's, `others`): an engine parameter's tile-hash partials (`TileHash`, each sender's
    slots of it) are combined, then finalized. Raises, naming them, if parameters still lack bytes (a sender
    missed some slots)."""
    ranks: list[dict[str, str | TileHash]] = [dict(rank) for rank in own]
    for other in others:
        for rank, part in zip(ranks, other):
            for name, value in part.items():
                held = rank.get(name)
                rank[name] = held.merge(value) if isinstance(held, TileHash) and isinstance(value, TileHash) else value
    missing = {f"{name} (rank {index})": f"{value.covered}/{value.total} bytes" for index, rank in enumerate(ranks)
               for name, value in rank.items() if isinstance(value, TileHash) and not value.complete}
    if missing:
        raise RuntimeError(f"the sync sent only some parts of these engine parameters: {missing}")
    return [{name: value.finalize() if isinstance(value, TileHash) else value for name, value in rank.items()}
            for rank in ranks]


def differing(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Engine parameters whose checksum is not the expected one, or that only one side has, sorted; each entry is
    the name, with ' (not sent)' or ' (not on the engine)' for one-sided ones."""
    wrong = [name for name in expected.keys() & actual.keys() if expected[name] != actual[name]]
    wrong += [f"{name} (not sent)" for name in actual.keys() - expected.keys()]
    wrong += [f"{name} (not on the engine)" for name in expected.keys() - actual.keys()]
    return sorted(wrong)
