"""The tensor names and shapes a Hugging Face config.json implies, from transformers itself (on the meta device:
no memory, no weights), so that a checkpoint whose weights do not fit its config is refused before conversion."""

from __future__ import annotations

import torch

from slimish.megatron_bridge.errors import CheckpointError


def expected_hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors transformers writes for `cfg` (save_pretrained's own reversal of its
    in-memory layout, e.g. fused experts back to one tensor per expert)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "torch_dtype")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **fields))
        saved = revert_weight_conversion(model, model.state_dict())
    return {name: tuple(t.shape) for name, t in saved.items()}


def check_shapes(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], *, source: str,
                 config: str) -> None:
    """Raise `CheckpointError` naming the first tensor of `found` whose shape is not the one `config` implies."""
    for name, shape in found.items():
        want = expected.get(name)
        if want is not None and tuple(shape) != want:
            raise CheckpointError(f"{source}: {name} has shape {tuple(shape)} but {config} implies {want}: the "
                                  "weights and the config are of different models; pass the matching config.json")
