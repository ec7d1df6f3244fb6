"""Offline conversion between an HF safetensors checkpoint and a Megatron-Core distributed checkpoint (torch_dist).

    hf_to_megatron(hf_dir=..., out_dir=..., tensor_parallel=1, pipeline_parallel=1)
    megatron_to_hf(megatron_dir=..., hf_config_dir=..., out_dir=...)

Both walk the bridge's rule table (`dense.model_rules`), the one the trainer loads and weight sync exports with,
and stream: one (fused) tensor is in memory at a time, so memory stays flat as the model grows. The distributed
checkpoint holds full (unsharded) tensors keyed as Megatron-Core's GPTModel names them, so the trainer loads it at
any TP/PP layout; `tensor_parallel` / `pipeline_parallel` only check that the model splits evenly at that layout.
Dtypes are kept as stored: HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from slimish.megatron_bridge import dense, dist_ckpt_io
from slimish.megatron_bridge.hf_config import Architecture, architecture_from_hf, read_hf_config
from slimish.megatron_bridge.hf_io import INDEX, HFCheckpoint, write_hf_shards


class LayoutError(ValueError):
    """The model does not split evenly at the requested parallel layout."""


def check_layout(arch: Architecture, *, tensor_parallel: int, pipeline_parallel: int) -> None:
    for what, value, parts in [("num_attention_heads", arch.num_attention_heads, tensor_parallel),
                               ("num_key_value_heads", arch.num_query_groups, tensor_parallel),
                               ("intermediate_size", arch.ffn_hidden_size, tensor_parallel),
                               ("vocab_size", arch.vocab_size, tensor_parallel),
                               ("num_hidden_layers", arch.num_layers, pipeline_parallel)]:
        if parts < 1 or value % parts:
            raise LayoutError(f"{what}={value} does not split over {parts} ranks")


def _megatron_meta(rule: dense.Rule, ckpt: HFCheckpoint, arch: Architecture) -> torch.Tensor:
    return dense.to_megatron(rule, [ckpt.meta(name) for name in rule.hf], arch)


def hf_to_megatron(*, hf_dir: str | Path, out_dir: str | Path, tensor_parallel: int = 1,
                   pipeline_parallel: int = 1, progress: bool = True) -> Path:
    """Write the HF checkpoint in `hf_dir` as a Megatron-Core torch_dist checkpoint in `out_dir`."""
    arch = architecture_from_hf(read_hf_config(hf_dir))
    check_layout(arch, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel)
    ckpt = HFCheckpoint(hf_dir)
    rules = dense.model_rules(arch)
    unmapped = set(ckpt.names()) - {name for rule in rules for name in rule.hf}
    if unmapped:
        raise ValueError(f"HF tensors with no Megatron mapping (would be dropped): {sorted(unmapped)[:5]}")
    bar = tqdm(total=sum(ckpt.nbytes(n) for n in ckpt.names()), unit="B", unit_scale=True, desc="hf->megatron",
               disable=not progress)

    def load(rule: dense.Rule, layered: bool):
        def data() -> torch.Tensor:
            tensor = dense.to_megatron(rule, [ckpt.get(name) for name in rule.hf], arch)
            bar.update(sum(ckpt.nbytes(name) for name in rule.hf))
            return tensor.unsqueeze(0) if layered else tensor
        return data

    chunks: dict[str, list] = {}
    dtypes: dict[str, torch.dtype] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rule in rules:
        key, layer = dense.checkpoint_key(rule.megatron)
        meta = _megatron_meta(rule, ckpt, arch)
        layered = layer is not None
        shape = (arch.num_layers, *meta.shape) if layered else tuple(meta.shape)
        if shapes.setdefault(key, shape) != shape or dtypes.setdefault(key, meta.dtype) != meta.dtype:
            raise ValueError(f"{key}: layers disagree on shape or dtype ({rule.hf[0]} is {tuple(meta.shape)} "
                             f"{meta.dtype})")
        offsets = (layer, *[0] * meta.dim()) if layered else (0,) * meta.dim()
        sizes = (1, *meta.shape) if layered else tuple(meta.shape)
        chunks.setdefault(key, []).append((offsets, sizes, load(rule, layered)))
    state: dict[str, object] = {key: dist_ckpt_io.LazyTensor(size=shapes[key], dtype=dtypes[key], chunks=parts)
                                for key, parts in chunks.items()}
    for key in dense.EXTRA_STATE_KEYS:
        for layer in range(arch.num_layers):
            # Megatron's ShardedObject naming: key/shard_{offset}_{shape}, holding the list of per-rank objects.
            state[f"{key}/shard_{layer}_{arch.num_layers}"] = [None]
    dist_ckpt_io.save(out_dir, state)
    bar.close()
    return Path(out_dir)


def megatron_to_hf(*, megatron_dir: str | Path, hf_config_dir: str | Path, out_dir: str | Path,
                   max_shard_bytes: int = 2 << 30, progress: bool = True) -> list[Path]:
    """Write the torch_dist checkpoint in `megatron_dir` as HF safetensors shards in `out_dir`, with config.json
    and the tokenizer files copied from `hf_config_dir`. Returns the shard files."""
    arch = architecture_from_hf(read_hf_config(hf_config_dir))
    ckpt = dist_ckpt_io.DistCheckpoint(megatron_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan, specs = [], []
    for rule in dense.model_rules(arch):
        key, layer = dense.checkpoint_key(rule.megatron)
        meta = ckpt.meta(key)
        if layer is not None:
            if meta.shape[0] != arch.num_layers:
                raise ValueError(f"{key}: checkpoint has {meta.shape[0]} layers, config.json {arch.num_layers}")
            meta = meta[0]
        plan.append((rule, key, layer, meta))
        specs += zip(rule.hf, dense.to_hf(rule, meta, arch))
    bar = tqdm(total=sum(m.numel() * m.element_size() for _, m in specs), unit="B", unit_scale=True,
               desc="megatron->hf", disable=not progress)

    def tensors():
        for rule, key, layer, meta in plan:
            if layer is None:
                full = ckpt.read(key, offsets=(0,) * meta.dim(), sizes=tuple(meta.shape))
            else:
                full = ckpt.read(key, offsets=(layer, *[0] * meta.dim()), sizes=(1, *meta.shape))[0]
            for name, tensor in zip(rule.hf, dense.to_hf(rule, full, arch)):
                bar.update(tensor.numel() * tensor.element_size())
                yield name, tensor

    files = write_hf_shards(out_dir, specs, tensors(), max_shard_bytes=max_shard_bytes)
    bar.close()
    _copy_side_files(Path(hf_config_dir), out_dir)
    return files


_SIDE_FILE_SUFFIXES = {".json", ".txt", ".model", ".jinja", ".tiktoken"}


def _copy_side_files(src: Path, dst: Path) -> None:
    """config.json, generation config and tokenizer files: everything but weights and the weight index."""
    for file in src.iterdir():
        if file.is_file() and file.suffix in _SIDE_FILE_SUFFIXES and file.name != INDEX:
            shutil.copy2(file, dst / file.name)
