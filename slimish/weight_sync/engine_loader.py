"""The weight loader slimish registers in its SGLang engines (`--custom-weight-loader`, `engine_flags.SHARD_LOADER`):
it runs inside each engine rank, called by SGLang's own `update_weights_from_tensor` when a request names it as its
`load_format`, with that rank's entry of `serialized_named_tensors` (SGLang hands rank r entry r).

The sharded `disk` transport writes each engine rank's parameters (SGLang names, that rank's layout:
`slimish.weight_sync.sharding.EngineShards`) to safetensors files of its own, and sends each rank
[(path of one of its files, a one-element int64 tensor holding the file's size)]: the rank reads only its own files
and copies each tensor into the parameter of its name (SGLang's `default_weight_loader`, shape checked), as
`load_format="direct"` copies tensors handed over in memory. Imports nothing of slimish: it runs in the engine.
"""

from __future__ import annotations

import os


def load_shard_files(model, named_tensors) -> None:
    """Load this rank's shard files named in `named_tensors` ([(path, its size in bytes as a tensor)]) into `model`
    by parameter name. A file of another size than the sender wrote (truncated, replaced) is refused."""
    from safetensors import safe_open
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    params = dict(model.named_parameters())
    for path, size in named_tensors:
        found = os.path.getsize(path)
        if found != int(size.item()):
            raise RuntimeError(f"weight shard {path}: {found} bytes, the sender wrote {int(size.item())}")
        with safe_open(path, framework="pt", device="cpu") as shard:
            for name in shard.keys():
                if name not in params:
                    raise KeyError(f"weight shard {path}: no parameter {name} on this engine rank")
                default_weight_loader(params[name], shard.get_tensor(name))
