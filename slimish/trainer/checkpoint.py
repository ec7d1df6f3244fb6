"""Save and load the trainer's policy model + optimizer with Megatron-Core's dist_checkpointing (torch_dist).

A checkpoint holds global tensors cut into whatever shards the saving layout had, so it loads at any TP / PP / DP
layout the model splits into (the optimizer state too, plain or distributed: trainer.optimizer.distributed must
match the run that saved it). It holds the policy only: the reference model (KL penalty) is the initial policy and
is rebuilt from `model.hf_path` (or `model.megatron_path`), and gradients are not kept (they are zeroed before
every step).
Every rank of the trainer group must call `save` / `load` with the same path on a filesystem all ranks share.

Adam's state round-trips whichever Adam runs (trainer.optimizer.adam, `slimish.trainer.adam`): torch's AdamW keeps
its step count as a tensor in every parameter's state, Transformer Engine's FusedAdam as an int in each param group,
and Megatron's checkpoint holds it once, in the param groups (per-parameter tensors hold the moments and the main
weights only). A distributed optimizer's checkpoint loads into either Adam; a plain optimizer's only into the Adam
that wrote it. With Megatron's CPU offload (trainer.optimizer.cpu_offload) the same holds for the Adams it runs in
host memory and on the GPU.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from slimish.compat import megatron_adam
from slimish.megatron_bridge.errors import CheckpointError
from slimish.trainer import optimizer_shards

logger = logging.getLogger(__name__)

# The distributed optimizer's state is saved per parameter, each rank writing and reading only its own shard
# (`slimish.trainer.optimizer_shards`, which replaces Megatron's param_state), so its checkpoints too load at any
# TP / PP / DP layout; but only by a distributed optimizer again. The sharding type named here is what Megatron's
# ChainedOptimizer reads to key its parts (as before: fully_reshardable checkpoints keep loading).
METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
OPTIMIZER_FILE = "slimish_optimizer.json"  # which optimizer wrote the checkpoint (distributed or plain, which Adam)


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
    for part in _distributed_parts(optimizer):
        optimizer_shards.install(part)
    models = {key: chunk.sharded_state_dict() for key, chunk in zip(_model_keys(chunks), chunks)}
    return {**models, "optimizer": optimizer.sharded_state_dict(models, is_loading=is_loading, metadata=METADATA)}


def critic_path(policy_path: str | Path) -> str:
    """Where the critic (PPO's value model) of the policy checkpoint at `policy_path` lives: `critic` beside it."""
    return str(Path(policy_path).parent / "critic")


def save(chunks: list, optimizer, path: str | Path, *, lr_schedule=None, writes=None) -> None:
    """Write the model's (this rank's model `chunks`) and the optimizer's (Adam moments, step, fp32 main params)
    sharded state to `path`, and the learning-rate schedule's position with it. With `writes` (a
    `background_writes.BackgroundWrites`), return once the state is staged: the files are written in the background
    and `path` is a dist checkpoint (metadata.json) only after `writes.finish()`."""
    from megatron.core import dist_checkpointing

    Path(path).mkdir(parents=True, exist_ok=True)
    state = _state(chunks, optimizer, is_loading=False)
    if writes is None:
        dist_checkpointing.save(state, str(path))
    else:
        writes.schedule(dist_checkpointing.save(state, str(path), async_sharded_save=True))
    if torch.distributed.get_rank() == 0:
        record = {"distributed": _is_distributed(optimizer), "adam": megatron_adam.megatron_builds()}
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
    written, running = record.get("adam"), megatron_adam.megatron_builds()
    if written and written != running:
        if not distributed:
            raise CheckpointError(f"{path} holds the state of a plain optimizer's {written} Adam, and this run builds "
                                  f"{running}: set trainer.optimizer.adam={written} to resume from it (a plain "
                                  "optimizer's checkpoint keeps the step count where its own Adam does)")
        logger.info("%s: Adam state written by %s, loaded into %s", path, written, running)
    # Megatron-Core 0.16's distributed optimizer mishandles torch's Adam (used without Transformer Engine / Apex)
    # and its CPU-offloading optimizer when it loads; the helpers below work around it.
    for part in distributed_parts:
        _create_empty_adam_state(part)
        _keep_adam_step_out_of_restored_tensors(part)
    # Megatron's CPU-offloading optimizer keeps its two Adam classes in its param groups, which the checkpoint's
    # common state holds: torch.load (weights_only) unpickles exactly those classes.
    with torch.serialization.safe_globals(_optimizer_classes(optimizer)):
        state = dist_checkpointing.load(_state(chunks, optimizer, is_loading=True), str(path))
    for key, chunk in zip(_model_keys(chunks), chunks):
        chunk.load_state_dict(state[key])
    optimizer.load_state_dict(state["optimizer"])
    for part in distributed_parts:
        _restore_adam_step_layout(part)
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


def _optimizer_classes(optimizer) -> list[type]:
    """The classes held in the param groups of the torch optimizers inside Megatron's `optimizer` (the CPU-offloading
    one's CPU and GPU Adam)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return list({value for part in parts for group in getattr(part.optimizer, "param_groups", ())
                 for value in group.values() if isinstance(value, type)})


def adams(part) -> list[torch.optim.Optimizer]:
    """The Adam optimizers inside one part of a Megatron optimizer: its torch optimizer, or the CPU-offloading
    optimizer's (`HybridDeviceOptimizer`: torch's AdamW in host memory, and trainer.optimizer.adam on the GPU for the
    share it keeps there)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    inner = getattr(part, "optimizer", None)
    if isinstance(inner, HybridDeviceOptimizer):
        return list(inner.sub_optimizers)
    return [inner] if inner is not None else []


def steps_per_parameter(adam: torch.optim.Optimizer) -> bool:
    """Whether `adam` keeps its step count per parameter (torch's Adam and AdamW: a tensor in each parameter's state)
    rather than per param group (TE's and apex's FusedAdam: an int in each group, shared by its parameters)."""
    return isinstance(adam, torch.optim.Adam | torch.optim.AdamW)


def _step_device(group: dict, param: torch.Tensor) -> torch.device:
    """Where torch's Adam keeps a parameter's step tensor: beside the parameter for its fused and capturable kernels
    (Megatron's CPU offload builds fused ones), on the CPU otherwise."""
    return param.device if group.get("fused") or group.get("capturable") else torch.device("cpu")


def _create_empty_adam_state(part) -> None:
    """Adam creates a parameter's state at its first step; the distributed optimizer's state_dict, which loading
    fills in, needs it to exist (with torch's Adam: its step tensor too). Zeros, to be overwritten by the checkpoint;
    a FusedAdam's step stays in its param groups, where the checkpoint's goes."""
    created = False
    for adam in adams(part):
        for group in adam.param_groups:
            for param in group["params"]:
                if adam.state[param]:
                    continue
                adam.state[param].update(exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
                if steps_per_parameter(adam):
                    adam.state[param]["step"] = torch.zeros((), dtype=torch.float32,
                                                            device=_step_device(group, param))
                created = True
    if created and hasattr(part.optimizer, "_sync_sub_optimizers_state_to_hdo"):
        part.optimizer._sync_sub_optimizers_state_to_hdo()  # the CPU-offloading optimizer's view of its Adams


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


def _restore_adam_step_layout(part) -> None:
    """After the distributed optimizer has loaded: each Adam's step count where that Adam keeps it, and its moments
    beside the parameters it updates.
    - torch's Adam: Megatron restores "step" as one tensor shared by every parameter's state; torch increments each
      parameter's step in place, so a shared one would advance once per parameter per step (and the bias correction
      with it). Every parameter gets its own, on the device its kernel reads it from. Megatron's CPU-offloading
      optimizer moves the state of every Adam that is a torch AdamW to the CPU, the one it runs on the GPU too (it
      tells them apart by class): that one's moments go back beside its parameters.
    - FusedAdam: the step is the param group's, an int (a checkpoint of torch's Adam holds a float; TE's kernel
      takes an int only), and no parameter's state holds one (TE's FusedAdam saves every state entry by name, and
      the CPU-offloading optimizer gives each parameter a step on load)."""
    for adam in adams(part):
        per_parameter = steps_per_parameter(adam)
        for group in adam.param_groups:
            if not per_parameter and "step" in group:
                group["step"] = int(group["step"])
            for param in group["params"]:
                state = adam.state.get(param)
                if not state:
                    continue
                if not per_parameter:
                    state.pop("step", None)
                elif "step" in state:
                    step, device = state["step"], _step_device(group, param)
                    if not isinstance(step, torch.Tensor):
                        step = torch.tensor(float(step), device="cpu")
                    state["step"] = step.detach().to(device, torch.float32, copy=True)
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state and state[key].device != param.device:
                        state[key] = state[key].to(param.device)
