"""What each engine parameter's checksum must be after a sync, on every tensor-parallel rank of an engine, computed
on the sender from the tensors it sends.

SGLang's `/weights_checker` (action "checksum") reports, per tensor-parallel rank of an engine, a checksum of every
parameter that rank holds under SGLang's own names. Which bytes those are (the fused q/k/v and gate/up, experts,
padding, key/value-head replication, MLA's splits) is `slimish.weight_sync.sharding`'s rule, the same one the
sharded sync cuts each rank's payload by: `ExpectedChecksums.add` hashes an HF tensor's per-rank slices
(`EngineLayout.pieces`) in part order as the tensors stream past, without building the fused tensors, and
`add_shard` hashes a rank's whole engine parameter as the sharded sync sends it (`EngineShards`).

The hash is SGLang's own (`sglang.srt.managers.mm_utils.tensor_hash`): on CPU the first 8 bytes of the SHA-256 of
the tensor's bytes, which is reproduced here (tests compare it with SGLang's function). On CUDA SGLang hashes with a
Triton kernel; `ExpectedChecksums` then builds each fused tensor and calls that kernel, the only difference being
the device.

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
    hasher: _Sha
    next_part: int = 0
    waiting: dict[int, torch.Tensor] = field(default_factory=dict)
    parts: list[torch.Tensor] = field(default_factory=list)  # on a GPU: the fused tensor is built


class ExpectedChecksums:
    """Feed every HF tensor of a sync (`add`); `result()` is then, per tensor-parallel rank of an engine sharded as
    `sharding` and holding `dtype` weights, {engine parameter name: checksum}.

    CPU tensors are hashed on a thread of their own (SHA-256 releases the GIL), in the order they were added, so
    hashing overlaps the transfer instead of lengthening it; a tensor is held until it is hashed. Tensors on a GPU
    are hashed where they are added."""

    def __init__(self, arch: Architecture, dtype: torch.dtype, sharding: EngineSharding = EngineSharding()):
        if not layout_supported(arch, sharding):
            raise ValueError(f"ExpectedChecksums does not know SGLang's parameters of this model on engines sharded "
                             f"as {sharding} (layout_supported)")
        self.arch, self.dtype, self.sharding = arch, dtype, sharding
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
        else:
            self._add_piece(rank, param, slot, self.layout.experts_per_rank(param), tensor)

    def _add_piece(self, rank: int, engine_name: str, part: int, num_parts: int, piece: torch.Tensor) -> None:
        done = self._done[rank]
        if num_parts == 1:
            done[engine_name] = (_checksum_as(piece, self.dtype) if _on_device(piece) else
                                 self._hasher.submit(_checksum_as, piece, self.dtype))
            return
        fused = self._fused.setdefault((rank, engine_name), _Fused(num_parts, _Sha(self.dtype)))
        fused.waiting[part] = piece
        while fused.next_part in fused.waiting:  # hash in part order; later parts wait for earlier ones
            piece = fused.waiting.pop(fused.next_part)
            if _on_device(piece):
                fused.parts.append(piece.to(self.dtype))
            else:
                self._hasher.submit(fused.hasher.update, piece)
            fused.next_part += 1
        if fused.next_part == fused.num_parts:
            del self._fused[(rank, engine_name)]
            done[engine_name] = (tensor_checksum(torch.cat([p.reshape(-1) for p in fused.parts]))
                                 if fused.parts else self._hasher.submit(fused.hasher.hexdigest))

    def result(self) -> list[dict[str, str]]:
        """The checksums, per tensor-parallel rank; raises if an engine parameter got only some of its parts (the
        export missed a tensor)."""
        self._hasher.shutdown(wait=True)
        if self._fused:
            missing = {(f"{name} (rank {rank})" if self.sharding.tp > 1 else name):
                       f"{f.next_part + len(f.waiting)}/{f.num_parts} parts"
                       for (rank, name), f in self._fused.items()}
            raise RuntimeError(f"the sync sent only some parts of these engine parameters: {missing}")
        return [{name: value.result() if isinstance(value, Future) else value for name, value in done.items()}
                for done in self._done]

def _checksum_as(tensor: torch.Tensor, dtype: torch.dtype) -> str:
    return tensor_checksum(tensor.to(dtype))


def differing(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Engine parameters whose checksum is not the expected one, or that only one side has, sorted; each entry is
    the name, with ' (not sent)' or ' (not on the engine)' for one-sided ones."""
    wrong = [name for name in expected.keys() & actual.keys() if expected[name] != actual[name]]
    wrong += [f"{name} (not sent)" for name in actual.keys() - expected.keys()]
    wrong += [f"{name} (not on the engine)" for name in expected.keys() - actual.keys()]
    return sorted(wrong)
