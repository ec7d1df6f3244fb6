"""How SGLang shards a model's parameters over the tensor-parallel ranks of an engine: the one rule both the
sharded weight sync (each engine rank is sent exactly the tensors it holds) and the expected checksums (what each
rank must hold after a sync, `slimish.weight_sync.checksums`) follow.

Several HF tensors land in one engine parameter: q/k/v in `qkv_proj`, gate/up in `gate_up_proj`, and every expert's
gate/up and down projections in `experts.w13_weight` / `experts.w2_weight` (expert-major). On an engine of
tensor-parallel size t, SGLang pads a tensor with zeros along the dimension it splits and gives rank r the r-th of t
equal slices of it:
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

`EngineLayout.pieces` cuts one HF tensor into its per-rank slices (each with its engine parameter and its place among
that parameter's parts); `EngineShards` assembles the slices into whole engine parameters, per rank, in SGLang's
layout (what `default_weight_loader` copies by name: SGLang's `load_format="direct"`), and `ExpectedChecksums` hashes
the same slices in the same order. tests/weight_sync/test_engine_sharding.py pins the rule against SGLang's own
loaders, and tests/weight_sync/test_sharded_payloads.py loads `EngineShards`' payloads into SGLang's own model ranks.

Covered (`layout_supported`): the dense and MoE families (llama, qwen2, qwen3, qwen3_moe, glm4_moe) on engines of
any tensor- and expert-parallel size SGLang accepts, except CPU engines whose size does not divide the attention
heads (SGLang then pads heads, not predicted here), and DeepSeek-V3's multi-latent attention (MLA: the down
projections whole on every rank, fused when there is a query LoRA; the up projections split by heads; `w_kc` /
`w_vc`, derived from `kv_b_proj` after loading, are not parameters and not reported). Not covered: engines with DP
attention (`rollout.engine.attention_data_parallel`). Sharded payloads: every covered layout; MLA's `w_kc` / `w_vc`,
which SGLang derives inside `load_weights`, need the model's post-processing after a copy by name, which SGLang's
stock `load_format="direct"` does not run (`direct_loadable`) and slimish's engine-side loaders do.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from slimish.megatron_bridge.hf_config import Architecture
from slimish.weight_sync.engine_loader import slot_name

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
    # Not sharding, but read from the same /server_info: the engine's --custom-weight-loader entries (load_formats
    # its /update_weights_from_tensor accepts beyond SGLang's own).
    loaders: tuple[str, ...] = field(default=(), compare=False, repr=False)
    # And its device ("cuda", "cpu"; "" when not said), which decides the checksum it reports (`checksums.hash_kind`).
    device: str = field(default="", compare=False, repr=False)

    @classmethod
    def of_server(cls, info: dict) -> EngineSharding:
        """From an engine's `/server_info` (SGLang's resolved arguments: DP attention's width is `attn_dp_size`)."""
        fusion = ("off" if info.get("disable_shared_experts_fusion") else
                  "forced" if info.get("enforce_shared_experts_fusion") else "auto")
        return cls(tp=int(info["tp_size"]), ep=int(info.get("ep_size") or 1),
                   attn_dp=int(info.get("attn_dp_size") or 1), cpu=info.get("device") == "cpu",
                   shared_experts_fusion=fusion, moe_a2a=str(info.get("moe_a2a_backend") or "none"),
                   batch_overlap=bool(info.get("enable_two_batch_overlap") or info.get("enable_single_batch_overlap")),
                   loaders=tuple(info.get("custom_weight_loader") or ()), device=str(info.get("device") or ""))


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


class EngineLayout:
    """The engine parameters of model `arch` on the ranks of an engine sharded as `sharding`."""

    def __init__(self, arch: Architecture, sharding: EngineSharding = EngineSharding(), *, expert_slots: bool = False):
        if not layout_supported(arch, sharding):
            raise ValueError(f"the engine parameters of this model on engines sharded as {sharding} are not known "
                             f"(layout_supported)")
        self.arch, self.sharding = arch, sharding
        # Experts sent one at a time into their slot of the stacked parameters (`engine_loader.slot_name`; needs
        # slimish's engine loaders), instead of a whole stacked parameter per rank.
        self.expert_slots = expert_slots and arch.moe is not None
        self.fused_shared = fuses_shared_experts(arch, sharding)
        # With the fusion, the shared expert is the last expert of w13_weight / w2_weight.
        self.num_experts = (arch.moe.num_experts + self.fused_shared) if arch.moe else 0

    @property
    def direct_loadable(self) -> bool:
        """Whether SGLang's stock `load_format="direct"` (a copy by name) loads an engine rank's parameters: not with
        MLA, whose `w_kc` / `w_vc` SGLang computes from `kv_b_proj` in `load_weights` (and in `post_load_weights`,
        which `/end_weight_update` runs only when nothing was loaded), so a bare copy would leave them stale; slimish's
        `engine_loader.load_by_name` copies and then post-processes. Nor expert slots, which only slimish's loaders
        know."""
        return self.arch.mla is None and not self.expert_slots

    def pieces(self, hf_name: str, tensor: torch.Tensor) -> Iterator[tuple[int, str, int, int, torch.Tensor]]:
        """(rank, engine parameter, index of this slice among the parameter's parts on that rank, number of parts,
        the slice) for every rank that holds a slice of HF tensor `hf_name`."""
        engine_name, part, num_parts, split = self.engine_slot(hf_name, tensor.shape)
        for rank in range(self.sharding.tp):
            piece = split.piece(tensor, rank)
            if piece is not None:
                yield rank, engine_name, part, num_parts, piece

    def experts_per_rank(self, engine_name: str) -> int:
        """How many experts a rank's `engine_name` stacks (0: not an expert parameter)."""
        if engine_name.endswith((".experts.w13_weight", ".experts.w2_weight")):
            return self.num_experts // self.sharding.ep
        return 0

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


class EngineShards:
    """Assembles `EngineLayout.pieces` into whole engine parameters, per rank: feed HF tensors with `add`, which
    returns the (rank, engine parameter, tensor in SGLang's layout) that tensor completed; `finish` raises if a
    parameter got only some of its parts. A parameter of one part is its slice (a view where no padding is added);
    a fused one is its parts concatenated in order (experts stacked: w13_weight [experts, 2 x rows, hidden],
    w2_weight [experts, hidden, columns]). Parts wait here until their parameter is complete (a layer's experts).

    With the layout's `expert_slots`, an expert parameter is not built whole: each expert is its own item as soon as
    its parts have passed, named by its slot (`engine_loader.slot_name`: w13_weight[k] = its gate and up slices
    [2 x rows, hidden], w2_weight[k] = its down slice [hidden, columns]), so only one expert's gate waits for its
    up here, never a layer's experts."""

    def __init__(self, layout: EngineLayout):
        self.layout = layout
        self._waiting: dict[tuple[int, str], dict[int, torch.Tensor]] = {}

    def add(self, hf_name: str, tensor: torch.Tensor) -> list[tuple[int, str, torch.Tensor]]:
        done = []
        for rank, name, part, num_parts, piece in self.layout.pieces(hf_name, tensor):
            if self.layout.expert_slots and self.layout.experts_per_rank(name):
                name, part, num_parts = expert_slot(name, part)
            if num_parts == 1:
                done.append((rank, name, piece))
                continue
            parts = self._waiting.setdefault((rank, name), {})
            parts[part] = piece
            if len(parts) == num_parts:
                del self._waiting[(rank, name)]
                done.append((rank, name, self._fuse(name, [parts[i] for i in range(num_parts)])))
        return done

    def _fuse(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        fused = torch.cat(parts, dim=0)
        experts = self.layout.experts_per_rank(name)
        return fused.view(experts, -1, *parts[0].shape[1:]) if experts else fused

    def finish(self) -> None:
        if self._waiting:
            missing = {(f"{name} (rank {rank})" if self.layout.sharding.tp > 1 else name): f"{len(parts)} parts"
                       for (rank, name), parts in self._waiting.items()}
            raise RuntimeError(f"the sync sent only some parts of these engine parameters: {missing}")

    def stream(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[int, str, torch.Tensor]]:
        """Every (rank, engine parameter, tensor) of `named_tensors`, each as soon as its last part has passed."""
        for hf_name, tensor in named_tensors:
            yield from self.add(hf_name, tensor)
        self.finish()


def expert_slot(engine_name: str, part: int) -> tuple[str, int, int]:
    """(the slot's name, this part's index in it, its number of parts) of part `part` of stacked expert parameter
    `engine_name` (`EngineLayout.engine_slot`'s numbering: w13_weight's 2k and 2k + 1 are expert k's gate and up,
    w2_weight's k its down)."""
    if engine_name.endswith(".w13_weight"):
        return slot_name(engine_name, part // 2), part % 2, 2
    return slot_name(engine_name, part), 0, 1


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
