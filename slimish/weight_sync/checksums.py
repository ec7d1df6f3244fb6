"""What each engine parameter's checksum must be after a sync, computed on the sender from the HF tensors it sends.

SGLang's `/weights_checker` (action "checksum") reports, per tensor-parallel rank of an engine, a checksum of every
parameter it holds under its own names. Several HF tensors land in one engine parameter: q/k/v in `qkv_proj`,
gate/up in `gate_up_proj`, and every expert's gate/up and down projections in `experts.w13_weight` /
`experts.w2_weight` (expert-major); the vocabulary is padded to a multiple of 64 rows of zeros. An engine
parameter's bytes are therefore its parts' bytes in a fixed order, and `ExpectedChecksums` hashes them in that
order as the tensors stream past, without building the fused tensor.

The hash is SGLang's own (`sglang.srt.managers.mm_utils.tensor_hash`): on CPU the first 8 bytes of the SHA-256 of
the tensor's bytes, which is reproduced here (tests compare it with SGLang's function). On CUDA SGLang hashes with a
Triton kernel; `ExpectedChecksums` then builds each fused tensor and calls that kernel, the only difference being
the device.

Covered: the layouts of the dense and MoE families (llama, qwen2, qwen3, qwen3_moe, glm4_moe) on engines of
tensor-parallel size 1. Not covered (`layout_supported` is False): MLA (DeepSeek-V3: SGLang derives `w_kc` / `w_vc`
from `kv_b_proj` after loading) and tensor-parallel engines (each rank holds a shard); for those the sync checks that
every engine reports the same checksums as the first one, and the new weight version.
"""

from __future__ import annotations

import hashlib
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from slimish.megatron_bridge.hf_config import Architecture

VOCAB_PADDING = 64  # sglang.srt.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def layout_supported(arch: Architecture, engine_tp: int) -> bool:
    """Whether `ExpectedChecksums` knows the engine parameters of this model on engines of `engine_tp` ranks."""
    return arch.mla is None and engine_tp == 1


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
    """An engine parameter made of `num_parts` HF tensors, hashed in part order as they arrive."""
    num_parts: int
    hasher: _Sha
    next_part: int = 0
    waiting: dict[int, torch.Tensor] = field(default_factory=dict)
    parts: list[torch.Tensor] = field(default_factory=list)  # on a GPU: the fused tensor is built


class ExpectedChecksums:
    """Feed every HF tensor of a sync (`add`); `result()` is then {engine parameter name: checksum} for an engine
    of tensor-parallel size 1 holding `dtype` weights.

    CPU tensors are hashed on a thread of their own (SHA-256 releases the GIL), in the order they were added, so
    hashing overlaps the transfer instead of lengthening it; a tensor is held until it is hashed. Tensors on a GPU
    are hashed where they are added."""

    def __init__(self, arch: Architecture, dtype: torch.dtype):
        if arch.mla is not None:
            raise ValueError("ExpectedChecksums does not know SGLang's MLA parameters (layout_supported)")
        self.arch, self.dtype = arch, dtype
        self.num_experts = arch.moe.num_experts if arch.moe else 0
        self._fused: dict[str, _Fused] = {}
        self._done: dict[str, str | Future] = {}
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="checksums")  # one thread: hashes in order

    def add(self, hf_name: str, tensor: torch.Tensor) -> None:
        engine_name, part, num_parts = self.engine_slot(hf_name)
        if hf_name in VOCAB_TENSORS:
            tensor = _pad_rows(tensor, VOCAB_PADDING)
        if num_parts == 1:
            self._done[engine_name] = (_checksum_as(tensor, self.dtype) if _on_device(tensor) else
                                       self._hasher.submit(_checksum_as, tensor, self.dtype))
            return
        fused = self._fused.setdefault(engine_name, _Fused(num_parts, _Sha(self.dtype)))
        fused.waiting[part] = tensor
        while fused.next_part in fused.waiting:  # hash in part order; later parts wait for earlier ones
            piece = fused.waiting.pop(fused.next_part)
            if _on_device(piece):
                fused.parts.append(piece.to(self.dtype))
            else:
                self._hasher.submit(fused.hasher.update, piece)
            fused.next_part += 1
        if fused.next_part == fused.num_parts:
            del self._fused[engine_name]
            self._done[engine_name] = (tensor_checksum(torch.cat([p.reshape(-1) for p in fused.parts]))
                                       if fused.parts else self._hasher.submit(fused.hasher.hexdigest))

    def result(self) -> dict[str, str]:
        """The checksums; raises if an engine parameter got only some of its parts (the export missed a tensor)."""
        self._hasher.shutdown(wait=True)
        if self._fused:
            missing = {name: f"{f.next_part + len(f.waiting)}/{f.num_parts} parts" for name, f in self._fused.items()}
            raise RuntimeError(f"the sync sent only some parts of these engine parameters: {missing}")
        return {name: value.result() if isinstance(value, Future) else value for name, value in self._done.items()}

    def engine_slot(self, hf_name: str) -> tuple[str, int, int]:
        """(engine parameter, index of this tensor among its parts, number of parts) of HF tensor `hf_name`."""
        if m := re.fullmatch(r"(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", hf_name):
            prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
            if proj == "down":
                return f"{prefix}.w2_weight", expert, self.num_experts
            return f"{prefix}.w13_weight", 2 * expert + (proj == "up"), 2 * self.num_experts
        if m := re.fullmatch(r"(.+\.self_attn)\.([qkv])_proj\.(weight|bias)", hf_name):
            return f"{m.group(1)}.qkv_proj.{m.group(3)}", "qkv".index(m.group(2)), 3
        if m := re.fullmatch(r"(.+)\.(gate|up)_proj\.weight", hf_name):
            return f"{m.group(1)}.gate_up_proj.weight", int(m.group(2) == "up"), 2
        return hf_name, 0, 1


def _pad_rows(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -tensor.shape[0] % multiple
    if not extra:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((extra, *tensor.shape[1:]))])


def _checksum_as(tensor: torch.Tensor, dtype: torch.dtype) -> str:
    return tensor_checksum(tensor.to(dtype))


def differing(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Engine parameters whose checksum is not the expected one, or that only one side has, sorted; each entry is
    the name, with ' (not sent)' or ' (not on the engine)' for one-sided ones."""
    wrong = [name for name in expected.keys() & actual.keys() if expected[name] != actual[name]]
    wrong += [f"{name} (not sent)" for name in actual.keys() - expected.keys()]
    wrong += [f"{name} (not on the engine)" for name in expected.keys() - actual.keys()]
    return sorted(wrong)
