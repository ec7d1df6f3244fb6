"""Streaming access to a Hugging Face safetensors checkpoint: one tensor at a time, memory-mapped.

A missing, truncated or corrupt shard raises `CheckpointError` naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(RuntimeError):
    pass


class HFCheckpoint:
    """Name -> tensor access over `model.safetensors` or an indexed set of shards."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.path / fname for name, fname in weight_map.items()}
        elif single.is_file():
            self.files = {name: single for name in self._open(single).keys()}
        else:
            raise CheckpointError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
        self._handles: dict[Path, object] = {}

    def _open(self, file: Path):
        if file not in getattr(self, "_handles", {}):
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for truncated headers
                raise CheckpointError(f"cannot read safetensors shard {file}: {exc}") from None
            if hasattr(self, "_handles"):
                self._handles[file] = handle
            return handle
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self.files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        file = self.files[name]
        try:
            return self._open(file).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor {name!r} from shard {file}: {exc}") from None
