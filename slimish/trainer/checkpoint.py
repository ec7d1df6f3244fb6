"""Save and load the trainer's policy model + optimizer with Megatron-Core's dist_checkpointing (torch_dist).

A checkpoint holds global tensors cut into whatever shards the saving layout had, so it loads at any TP / PP / DP
layout the model splits into. It holds the policy only: the reference model (KL penalty) is the initial policy and
is rebuilt from `model.hf_path`, and gradients are not kept (they are zeroed before every step).
Every rank of the trainer group must call `save` / `load` with the same path on a filesystem all ranks share.
"""

from __future__ import annotations

from pathlib import Path


def _state(module, optimizer, *, is_loading: bool) -> dict:
    model_sd = module.sharded_state_dict()
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}


def save(module, optimizer, path: str | Path) -> None:
    """Write the model's and the optimizer's (Adam moments, step, fp32 main params) sharded state to `path`."""
    from megatron.core import dist_checkpointing

    Path(path).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(_state(module, optimizer, is_loading=False), str(path))


def load(module, optimizer, path: str | Path) -> None:
    """Overwrite the model's weights and the optimizer's state in place with the checkpoint at `path`."""
    from megatron.core import dist_checkpointing

    if not (Path(path) / "metadata.json").is_file():
        raise FileNotFoundError(f"{path}: not a Megatron dist checkpoint (no metadata.json)")
    state = dist_checkpointing.load(_state(module, optimizer, is_loading=True), str(path))
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
