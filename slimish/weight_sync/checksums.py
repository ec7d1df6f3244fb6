"""What each engine parameter's checksum must be after a sync, on every tensor-parallel rank of an engine, computed
on the sender from the HF tensors it sends.

SGLang's `/weights_checker` (action "checksum") reports, per tensor-parallel rank of an engine, a checksum of every
parameter that rank holds under SGLang's own names. Several HF tensors land in one engine parameter: q/k/v in
`qkv_proj`, gate/up in `gate_up_proj`, and every expert's gate/up and down projections in `experts.w13_weight` /
`experts.w2_weight` (expert-major). On an engine of tensor-parallel size t, SGLang pads a tensor with zeros along
the dimension it splits and gives rank r the r-th of t equal slices of it (`EngineSharding` says how, per tensor):
- column-parallel (q/k/v, gate/up, their biases): rows; a rank's fused parameter is its slice of each part, in
  part order;
- row-parallel (o_proj, down_proj): columns;
- the vocabulary (embed_tokens, lm_head): rows, padded to a multiple of 64 (of 64 x t when that does not divide);
- key/value heads when t exceeds their number: each head is held whole by t / num_kv_heads ranks;
- experts: with expert-parallel size e, rank r holds the experts of block r // (t / e), each split t / e ways;
- on a CPU engine, SGLang pads every MLP's intermediate size to a multiple of 32 x t;
- the rest (norms, the router) whole on every rank;
- on a GPU, DeepSeek-V3's and GLM-4.5's shared expert is usually loaded as one more routed expert, the last one of
  `w13_weight` / `w2_weight` (`fuses_shared_experts` says when).
An engine parameter's bytes on a rank are therefore its parts' slices in a fixed order, and `ExpectedChecksums`
hashes them in that order as the tensors stream past, without building the fused tensor.

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
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from slimish.megatron_bridge.hf_config import Architecture

VOCAB_PADDING = 64  # sglang.srt.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
CPU_INTERMEDIATE_PADDING = 32  # sglang.srt.configs.update_config.DEFAULT_MOE_PADDING_SIZE, times the TP size
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class EngineSharding:
    """How SGLang splits an engine's parameters over its ranks: `tp` its --tp-size, `ep` its --ep-size (experts),
    `attn_dp` its --attn-dp-size (DP attention: attention split over tp / attn_dp ranks, repeated per group), `cpu`
    whether it runs on the CPU (SGLang then pads intermediate sizes). For the shared experts' fusion
    (`fuses_shared_experts`): `shared_experts_fusion` "off" (--disable-shared-experts-fusion), "forced"
    (--enforce-shared-experts-fusion) or "auto", `moe_a2a` its --moe-a2a-backend, `batch_overlap` whether two- or
    single-batch overlap is on."""
    tp: int = 1
    ep: int = 1
    attn_dp: int = 1
    cpu: bool = False
    shared_experts_fusion: str = "auto"
    moe_a2a: str = "none"
    batch_overlap: bool = False

    @classmethod
    def of_server(cls, info: dict) -> EngineSharding:
        """From an engine's `/server_info` (SGLang's resolved arguments: DP attention's width is `attn_dp_size`)."""
        fusion = ("off" if info.get("disable_shared_experts_fusion") else
                  "forced" if info.get("enforce_shared_experts_fusion") else "auto")
        return cls(tp=int(info["tp_size"]), ep=int(info.get("ep_size") or 1),
                   attn_dp=int(info.get("attn_dp_size") or 1), cpu=info.get("device") == "cpu",
                   shared_experts_fusion=fusion, moe_a2a=str(info.get("moe_a2a_backend") or "none"),
                   batch_overlap=bool(info.get("enable_two_batch_overlap") or info.get("enable_single_batch_overlap")))


# The all-to-all backends under which each family's SGLang model leaves its shared experts unfused.
_FUSION_BLOCKING_A2A = {"deepseek_v3": {"deepep", "deepep_v2", "mooncake", "mori", "pplx"},
                        "glm4_moe": {"deepep", "mori"}}


def fuses_shared_experts(arch: Architecture, sharding: EngineSharding) -> bool:
    """Whether SGLang loads the model's shared expert as one more routed expert (`experts.{num_experts}` of
    `w13_weight` / `w2_weight`; no `shared_experts` parameters): `resolve_shared_experts_config` with the
    `shared_experts_fusion_disable_reason` of DeepseekV3ForCausalLM and Glm4MoeForCausalLM, for unquantised weights
    on NVIDIA GPUs of compute capability 8.0 or more (those of the GPU lock). On the CPU never, unless forced for
    DeepSeek-V3. Pinned by tests/weight_sync/test_engine_sharding.py."""
    moe, family, fusion = arch.moe, arch.family, sharding.shared_experts_fusion
    if moe is None or not moe.shared_ffn_hidden_size or fusion == "off" or family not in _FUSION_BLOCKING_A2A:
        return False
    if family == "deepseek_v3":
        if fusion == "forced":
            return True
        single_shared = moe.shared_ffn_hidden_size == moe.ffn_hidden_size
        if sharding.batch_overlap or not (moe.num_experts == 256 and single_shared):  # DeepSeek-V3 / R1's shape
            return False
    if sharding.moe_a2a in _FUSION_BLOCKING_A2A[family]:
        return False
    return not sharding.cpu and sharding.ep == 1


def sharding_of(url: str, *, api_key: str | None, new_client=None) -> EngineSharding:
    """How the engine at `url` shards its parameters (asked of its `/server_info`, through
    `new_client(url, api_key=...)`: an `EngineClient` by default)."""
    if new_client is None:
        from slimish.engines.client import EngineClient as new_client

    client = new_client(url, api_key=api_key)
    try:
        return EngineSharding.of_server(client.server_info())
    finally:
        client.close()


def layout_supported(arch: Architecture, sharding: EngineSharding) -> bool:
    """Whether `ExpectedChecksums` knows the engine parameters of this model on engines sharded as `sharding`."""
    if sharding.attn_dp > 1:  # DP attention: not predicted (nor pinned) yet
        return False
    if fuses_shared_experts(arch, sharding) and (sharding.ep > 1 or sharding.moe_a2a != "none"):
        return False  # a fused shared expert in per-rank slots of the expert-parallel blocks: not predicted
    tp = sharding.tp
    if tp == 1:
        return True
    heads, kv_heads = arch.num_attention_heads, arch.num_query_groups
    if arch.mla is not None:  # SGLang splits MLA's heads, and refuses a tp that does not divide them
        return heads % tp == 0
    if sharding.cpu:  # SGLang pads heads (and key/value heads) that tp does not divide, on the CPU only
        return heads % tp == 0 and kv_heads % tp == 0
    return heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)


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


@dataclass(frozen=True)
class _Split:
    """How one HF tensor is cut for the ranks: padded with zeros to `padded` along `dim`, then in `blocks` equal
    slices, rank r holding slice `block(r)` (None: the tensor is not on rank r). dim None: whole on every rank."""
    dim: int | None = None
    padded: int = 0
    blocks: int = 1
    rank_block: tuple[int | None, ...] = ()

    def piece(self, tensor: torch.Tensor, rank: int) -> torch.Tensor | None:
        """Rank `rank`'s slice of `tensor` (a view unless it reaches into the padding, which only it is built of)."""
        if self.dim is None:
            return tensor
        block = self.rank_block[rank]
        if block is None:
            return None
        size = self.padded // self.blocks
        start = block * size
        real = max(0, min(size, tensor.shape[self.dim] - start))  # rows (or columns) of the tensor in the slice
        piece = tensor.narrow(self.dim, min(start, tensor.shape[self.dim]), real)
        if real == size:
            return piece
        zeros = tensor.new_zeros((*tensor.shape[:self.dim], size - real, *tensor.shape[self.dim + 1:]))
        return torch.cat([piece, zeros], dim=self.dim)


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
        self.fused_shared = fuses_shared_experts(arch, sharding)
        # With the fusion, the shared expert is the last expert of w13_weight / w2_weight.
        self.num_experts = (arch.moe.num_experts + self.fused_shared) if arch.moe else 0
        self._fused: dict[tuple[int, str], _Fused] = {}
        self._done: list[dict[str, str | Future]] = [{} for _ in range(sharding.tp)]
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="checksums")  # one thread: hashes in order

    def add(self, hf_name: str, tensor: torch.Tensor) -> None:
        engine_name, part, num_parts, split = self.engine_slot(hf_name, tensor.shape)
        for rank in range(self.sharding.tp):
            piece = split.piece(tensor, rank)
            if piece is None:
                continue
            self._add_piece(rank, engine_name, part, num_parts, piece)

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

    def engine_slot(self, hf_name: str, shape: tuple[int, ...] | torch.Size) -> tuple[str, int, int, _Split]:
        """(engine parameter, index of this tensor among its parts on a rank that holds it, number of parts there,
        how it is split over the ranks) of HF tensor `hf_name` of `shape`. Experts count from the first one of the
        rank's expert-parallel block."""
        if self.fused_shared and ".mlp.shared_experts." in hf_name:
            hf_name = hf_name.replace(".mlp.shared_experts.", f".mlp.experts.{self.arch.moe.num_experts}.")
        if m := re.fullmatch(r"(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", hf_name):
            prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
            per_rank = self.num_experts // self.sharding.ep  # the experts of one expert-parallel block
            split = self._expert_split(expert // per_rank, shape, dim=1 if proj == "down" else 0)
            local = expert % per_rank
            if proj == "down":
                return f"{prefix}.w2_weight", local, per_rank, split
            return f"{prefix}.w13_weight", 2 * local + (proj == "up"), 2 * per_rank, split
        if self.arch.mla is not None and (slot := self._mla_slot(hf_name, shape)):
            return slot
        if m := re.fullmatch(r"(.+\.self_attn)\.([qkv])_proj\.(weight|bias)", hf_name):
            return (f"{m.group(1)}.qkv_proj.{m.group(3)}", "qkv".index(m.group(2)), 3,
                    self._head_split(m.group(2), shape))
        if m := re.fullmatch(r"(.+)\.(gate|up)_proj\.weight", hf_name):
            return (f"{m.group(1)}.gate_up_proj.weight", int(m.group(2) == "up"), 2,
                    self._split(0, self._intermediate(shape[0])))
        if re.fullmatch(r".+\.down_proj\.weight", hf_name):
            return hf_name, 0, 1, self._split(1, self._intermediate(shape[1]))
        if re.fullmatch(r".+\.self_attn\.o_proj\.weight", hf_name):
            return hf_name, 0, 1, self._split(1, shape[1])
        if hf_name in VOCAB_TENSORS:
            return hf_name, 0, 1, self._vocab_split(shape[0])
        return hf_name, 0, 1, _Split()

    def _mla_slot(self, hf_name: str, shape) -> tuple[str, int, int, _Split] | None:
        """MLA's projections (None for the rest). The down projections are replicated: with a query LoRA, SGLang
        fuses q_a_proj and kv_a_proj_with_mqa into `fused_qkv_a_proj_with_mqa`, whole on every rank. The up
        projections (q_b_proj or the full-rank q_proj, kv_b_proj) are column-parallel by heads, o_proj row-parallel
        (the general rule); the latent norms are whole. `w_kc` / `w_vc`, which SGLang derives from kv_b_proj after
        loading, are not parameters: `/weights_checker` does not report them, and kv_b_proj stands for them."""
        m = re.fullmatch(r"(.+\.self_attn)\.(q_a_proj|kv_a_proj_with_mqa|q_b_proj|kv_b_proj|q_proj)\.weight", hf_name)
        if m is None:
            return None
        attn, proj = m.groups()
        if proj in ("q_b_proj", "kv_b_proj", "q_proj"):
            return hf_name, 0, 1, self._split(0, shape[0])
        if self.arch.mla.q_lora_rank is None:
            return hf_name, 0, 1, _Split()
        return f"{attn}.fused_qkv_a_proj_with_mqa.weight", int(proj == "kv_a_proj_with_mqa"), 2, _Split()

    def _split(self, dim: int, length: int, blocks: int | None = None, rank_block=None) -> _Split:
        tp = self.sharding.tp
        blocks = blocks or tp
        return _Split(dim=dim, padded=length, blocks=blocks,
                      rank_block=tuple(rank_block or (r * blocks // tp for r in range(tp))))

    def _intermediate(self, length: int) -> int:
        """An MLP's intermediate size on the engine: padded to a multiple of 32 x tp on the CPU."""
        if not self.sharding.cpu:
            return length
        return _round_up(length, CPU_INTERMEDIATE_PADDING * self.sharding.tp)

    def _vocab_split(self, rows: int) -> _Split:
        padding = VOCAB_PADDING
        if _round_up(rows, padding) % self.sharding.tp:
            padding *= self.sharding.tp
        return _Split(dim=0, padded=_round_up(rows, padding), blocks=self.sharding.tp,
                      rank_block=tuple(range(self.sharding.tp)))

    def _head_split(self, which: str, shape) -> _Split:
        """q rows split over the ranks; key/value rows too, or, with fewer key/value heads than ranks, each head
        whole on tp / num_kv_heads consecutive ranks."""
        tp = self.sharding.tp
        if tp == 1:
            return _Split()
        kv_heads = self.arch.num_query_groups
        if which == "q" or kv_heads >= tp:
            return self._split(0, shape[0])
        return self._split(0, shape[0], blocks=kv_heads, rank_block=[r // (tp // kv_heads) for r in range(tp)])

    def _expert_split(self, block: int, shape, dim: int) -> _Split:
        """A tensor of an expert of expert-parallel block `block`: on that block's ranks, split over the tp / ep
        ranks in it."""
        tp, ep = self.sharding.tp, self.sharding.ep
        moe_tp = tp // ep
        blocks = [(r % moe_tp) if r // moe_tp == block else None for r in range(tp)]
        return _Split(dim=dim, padded=self._intermediate(shape[dim]), blocks=moe_tp, rank_block=tuple(blocks))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _checksum_as(tensor: torch.Tensor, dtype: torch.dtype) -> str:
    return tensor_checksum(tensor.to(dtype))


def differing(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Engine parameters whose checksum is not the expected one, or that only one side has, sorted; each entry is
    the name, with ' (not sent)' or ' (not on the engine)' for one-sided ones."""
    wrong = [name for name in expected.keys() & actual.keys() if expected[name] != actual[name]]
    wrong += [f"{name} (not sent)" for name in actual.keys() - expected.keys()]
    wrong += [f"{name} (not on the engine)" for name in expected.keys() - actual.keys()]
    return sorted(wrong)
