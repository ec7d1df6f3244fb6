"""Save and load the trainer's policy model + optimizer with Megatron-Core's dist_checkpointing (torch_dist).

A checkpoint holds global tensors cut into whatever shards the saving layout had, so it loads at any TP / PP / DP
layout the model splits into (the optimizer state too, plain or distributed: trainer.optimizer.distributed must
match the run that saved it). It holds the policy only: the reference model (KL penalty) is the initial policy and
is rebuilt from `model.hf_path`, and gradients are not kept (they are zeroed before every step).
Every rank of the trainer group must call `save` / `load` with the same path on a filesystem all ranks share.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from slimish.megatron_bridge.errors import CheckpointError

# The distributed optimizer's state is saved per parameter (gathered over the data-parallel group on save, sliced on
# load), so its checkpoints too load at any TP / PP / DP layout; but only by a distributed optimizer again.
# (Its default format in Megatron-Core 0.16, fully_sharded_model_space, no longer saves: flattened ShardedTensors.)
METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
OPTIMIZER_FILE = "slimish_optimizer.json"  # which optimizer wrote the checkpoint


def _distributed_parts(optimizer) -> list:
    """The distributed optimizers in Megatron's ChainedOptimizer (or the optimizer itself, if it is one)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part for part in parts if isinstance(part, DistributedOptimizer)]


def _is_distributed(optimizer) -> bool:
    return bool(_distributed_parts(optimizer))


def _model_keys(chunks: list) -> list[str]:
    """Where each model chunk's state sits in the checkpoint's dict: "model", or "model0", "model1", ... for
    virtual-pipeline chunks (as Megatron-LM names them). Only the dict's shape: the tensors are keyed by their global
    names, so a checkpoint loads at any layout, virtual pipeline or not."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _state(chunks: list, optimizer, *, is_loading: bool) -> dict:
    models = {key: chunk.sharded_state_dict() for key, chunk in zip(_model_keys(chunks), chunks)}
    return {**models, "optimizer": optimizer.sharded_state_dict(models, is_loading=is_loading, metadata=METADATA)}


def critic_path(policy_path: str | Path) -> str:
    """Where the critic (PPO's value model) of the policy checkpoint at `policy_path` lives: `critic` beside it."""
    return str(Path(policy_path).parent / "critic")


def save(chunks: list, optimizer, path: str | Path, *, lr_schedule=None) -> None:
    """Write the model's (this rank's model `chunks`) and the optimizer's (Adam moments, step, fp32 main params)
    sharded state to `path`, and the learning-rate schedule's position with it."""
    from megatron.core import dist_checkpointing

    Path(path).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(_state(chunks, optimizer, is_loading=False), str(path))
    if torch.distributed.get_rank() == 0:
        record = {"distributed": _is_distributed(optimizer)}
        if lr_schedule is not None:
            record["lr_schedule"] = lr_schedule.state_dict()
        (Path(path) / OPTIMIZER_FILE).write_text(json.dumps(record) + "\n")


def load(chunks: list, optimizer, path: str | Path, *, lr_schedule=None) -> None:
    """Overwrite the model's weights (this rank's model `chunks`) and the optimizer's state in place with the
    checkpoint at `path`; continue `lr_schedule` from the checkpoint's step (a checkpoint without one restarts the
    schedule)."""
    from megatron.core import dist_checkpointing

    if not (Path(path) / "metadata.json").is_file():
        raise CheckpointError(f"{path}: not a Megatron dist checkpoint (no metadata.json); point checkpoint.resume at "
                              "a complete checkpoints/step_<N> directory")
    record_path = Path(path) / OPTIMIZER_FILE
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    distributed = record.get("distributed", False)
    distributed_parts = _distributed_parts(optimizer)
    if distributed != bool(distributed_parts):
        raise CheckpointError(f"{path} holds the state of a {'distributed' if distributed else 'plain'} optimizer: set "
                              f"trainer.optimizer.distributed={str(distributed).lower()} to resume from it (the two "
                              "keep Adam's state in different layouts)")
    _check_optimizer_parts(optimizer, path)
    # Megatron-Core 0.16's distributed optimizer mishandles torch's Adam (used without Transformer Engine / Apex)
    # when it loads; the three helpers below work around it.
    for part in distributed_parts:
        _create_empty_adam_state(part)
        _keep_adam_step_out_of_restored_tensors(part)
    state = dist_checkpointing.load(_state(chunks, optimizer, is_loading=True), str(path))
    for key, chunk in zip(_model_keys(chunks), chunks):
        chunk.load_state_dict(state[key])
    optimizer.load_state_dict(state["optimizer"])
    for part in distributed_parts:
        _unshare_adam_steps(part)
    if lr_schedule is not None and "lr_schedule" in record:
        from slimish.trainer.lr_schedule import load_position

        load_position(lr_schedule, record["lr_schedule"])


def _check_optimizer_parts(optimizer, path: str | Path) -> None:
    """A mixture-of-experts model's optimizer has two parts (the rest, and the experts: `trainer.model.
    _mark_expert_data_parallel`), a dense model's one; Megatron prefixes each part's state when there are two. A
    checkpoint saved with another number of parts (a MoE model's before its experts had a part of their own at
    expert_parallel 1) would fail in Megatron's loader with every key listed: say it in one line."""
    from megatron.core import dist_checkpointing

    parts = len(getattr(optimizer, "chained_optimizers", [optimizer]))
    keys = dist_checkpointing.load_tensors_metadata(str(path))
    saved_parts = 2 if any(key.startswith("chained_") for key in keys) else 1
    if saved_parts != parts:
        raise CheckpointError(f"{path} holds an optimizer of {saved_parts} part(s), this model's has {parts}: a "
                              "mixture-of-experts checkpoint saved before the experts' Adam state was kept apart at "
                              "every layout (slimish b8785f8 or older, at expert_parallel 1), or another model's. "
                              "Resume it with the slimish that saved it, or convert its model (slimish convert "
                              "megatron-to-hf) and start from that")


def _create_empty_adam_state(part) -> None:
    """torch's Adam creates a parameter's state at its first step; the distributed optimizer's state_dict, which
    loading fills in, needs it to exist. Zeros, to be overwritten by the checkpoint."""
    inner = part.optimizer
    if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
        return
    for group in inner.param_groups:
        for param in group["params"]:
            if not inner.state[param]:  # torch's (non-fused) Adam keeps its step count on the CPU
                inner.state[param].update(step=torch.tensor(0.0, device="cpu"), exp_avg=torch.zeros_like(param),
                                          exp_avg_sq=torch.zeros_like(param))


def _keep_adam_step_out_of_restored_tensors(part) -> None:
    """The distributed optimizer restores torch Adam's per-parameter "step" from the param groups, skips it among
    the checkpoint's per-parameter tensors, then copies every key of the parameter's state from those tensors
    ("step" included: KeyError). Leave "step" out of that copy."""
    if "_set_main_param_and_optimizer_states" in vars(part):
        return
    original = part._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group_index, group_order = part.model_param_group_index_map[model_param]
        state = part.optimizer.state[part.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            original(model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    part._set_main_param_and_optimizer_states = set_states


def _unshare_adam_steps(part) -> None:
    """The distributed optimizer restores torch Adam's "step" as one tensor shared by every parameter's state; torch
    increments each parameter's step in place, so a shared one would advance once per parameter per step (and the
    bias correction with it). Give every parameter its own."""
    for state in part.optimizer.state.values():
        if "step" in state and hasattr(state["step"], "clone"):
            state["step"] = state["step"].clone()
