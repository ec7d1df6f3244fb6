"""The bridge at the real sizes of the target models (Llama-3.1-405B, Qwen3-8B, Qwen3-30B-A3B, DeepSeek-V3,
GLM-4.5), on the meta device: the Megatron GPTModel built from each config.json has exactly one rule per weight,
the rules name exactly the tensors transformers builds for that config, every rule's HF shapes fuse into its
Megatron parameter's shape and split back, and both models count the same parameters. The tiny-model tests check
the numbers; this one checks that head counts, group sizes, expert counts and widths of the real models map."""

from __future__ import annotations

import pytest
import torch

from slimish.megatron_bridge import dense
from slimish.megatron_bridge.hf_config import architecture_from_hf
from slimish.megatron_bridge.hf_shapes import transformers_hf_shapes
from tests.megatron_bridge.real_configs import REAL_CONFIGS, trimmed

# Parameters of the whole model (untrimmed), as its model card states them, to the stated precision.
BILLIONS = {"llama31_405b": (405.85, 0.01), "qwen3_8b": (8.19, 0.01)}


def megatron_meta_shapes(arch) -> dict[str, tuple[int, ...]]:
    from slimish.trainer.model import build_gpt_model

    with torch.device("meta"):
        model = build_gpt_model(arch, tensor_parallel=1, pipeline_parallel=1)
    shapes = {dense.canonical_megatron_name(n): tuple(p.shape) for n, p in model.named_parameters()}
    shapes.update({n: tuple(b.shape) for n, b in model.named_buffers() if n.endswith("router.expert_bias")})
    return shapes


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_real_config_maps_every_tensor_at_its_shape(name, megatron_world):
    cfg = trimmed(name)
    arch = architecture_from_hf(cfg)
    hf = transformers_hf_shapes(cfg)
    megatron = megatron_meta_shapes(arch)
    rules = dense.model_rules(arch)
    assert {r.megatron for r in rules} == set(megatron), "one rule per Megatron weight"
    assert sorted(n for r in rules for n in r.hf) == sorted(hf), "the rules name exactly transformers' tensors"
    for rule in rules:
        hf_tensors = [torch.empty(hf[n], device="meta") for n in rule.hf]
        fused = dense.to_megatron(rule, hf_tensors, arch)
        assert tuple(fused.shape) == megatron[rule.megatron] == dense.megatron_shape(rule, [hf[n] for n in rule.hf])
        assert [tuple(t.shape) for t in dense.to_hf(rule, fused, arch)] == [hf[n] for n in rule.hf], rule.megatron
    count = sum(torch.Size(s).numel() for s in megatron.values())
    assert count == sum(torch.Size(s).numel() for s in hf.values())
    if name in BILLIONS:
        billions, precision = BILLIONS[name]
        assert abs(count / 1e9 - billions) < precision, f"{name}: {count:,} parameters"


def test_real_moe_configs_route_as_released():
    qwen = architecture_from_hf(REAL_CONFIGS["qwen3_30b_a3b"]).moe
    assert (qwen.num_experts, qwen.topk, qwen.ffn_hidden_size, set(qwen.layer_pattern)) == (128, 8, 768, {1})
    deepseek = architecture_from_hf(REAL_CONFIGS["deepseek_v3"])
    assert deepseek.moe.layer_pattern == (0, 0, 0) + (1,) * 58 and deepseek.mtp_layers == 1
    assert (deepseek.moe.num_groups, deepseek.moe.group_topk, deepseek.moe.scaling_factor) == (8, 4, 2.5)
    assert (deepseek.mla.q_lora_rank, deepseek.mla.kv_lora_rank, deepseek.mla.rope_type) == (1536, 512, "yarn")
    glm = architecture_from_hf(REAL_CONFIGS["glm45"])
    assert glm.moe.layer_pattern == (0, 0, 0) + (1,) * 89 and glm.moe.shared_ffn_hidden_size == 1536
    assert (glm.rotary_percent, glm.add_qkv_bias, glm.qk_layernorm) == (0.5, True, True)


def _few_experts(name: str) -> dict:
    """`name`'s config at its real layer count, with 8 routed experts (the pipeline split is about layers; building
    every expert of every layer on the meta device only costs time) and no multi-token-prediction layer."""
    cfg = {**REAL_CONFIGS[name]}
    cfg.pop("num_nextn_predict_layers", None)
    for key in ("n_routed_experts", "num_experts"):
        if key in cfg:
            cfg[key] = 8
    if "n_group" in cfg:
        cfg["n_group"], cfg["topk_group"] = 1, 1
    if "num_experts_per_tok" in cfg:
        cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], 8)
    return cfg


def _split_for(num_layers: int, pp: int) -> dict:
    """The first / last stage overrides that make `num_layers` split over `pp` stages: none when pp divides it,
    else the remainder on the first stage."""
    if num_layers % pp == 0:
        return {}
    return {"first": num_layers - (pp - 1) * (num_layers // pp)}


def _build_stages(arch, pp: int, split: dict) -> list[list[int]]:
    """Each pipeline stage of `arch` over `pp` stages built on the meta device (Megatron's mock pipeline rank and
    size): the global layer numbers each stage holds (its layer count from the build, its offset Megatron's)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from slimish.trainer.model import build_gpt_model

    held = []
    try:
        ps.set_pipeline_model_parallel_world_size(pp)
        for stage in range(pp):
            ps.set_pipeline_model_parallel_rank(stage)
            with torch.device("meta"):
                model = build_gpt_model(arch, tensor_parallel=1, pipeline_parallel=pp, first_stage_layers=split.get(
                    "first", 0), last_stage_layers=split.get("last", 0))
            # The layers' own numbers come from the (real, one-rank) pipeline group; Megatron's offset of the stage:
            offset = get_transformer_layer_offset(model.config, pp_rank=stage)
            held.append(list(range(offset + 1, offset + 1 + len(model.decoder.layers))))
            assert (model.pre_process, model.post_process) == (stage == 0, stage == pp - 1)
    finally:
        ps.set_pipeline_model_parallel_world_size(None)
        ps.set_pipeline_model_parallel_rank(None)
    return held


@pytest.mark.parametrize("name", ["qwen3_8b", "qwen3_30b_a3b", "llama31_405b", "deepseek_v3", "glm45"])
@pytest.mark.parametrize("pp", [2, 4, 8])
def test_every_pipeline_split_check_config_accepts_builds(name, pp, megatron_world):
    """What `pipeline_stage_layers` (check-config and plan) accepts, Megatron builds: every stage on the meta device,
    each layer on exactly one stage, as many on each as the split says (DeepSeek-V3's 61 layers over PP4 and PP8 with
    the remainder on the first stage); and an even split of a layer count the stages do not divide is refused by both
    (Megatron at build time)."""
    from slimish.megatron_bridge.hf_config import pipeline_stage_layers

    arch = architecture_from_hf(_few_experts(name))
    split = _split_for(arch.num_layers, pp)
    counts = pipeline_stage_layers(arch.num_layers, pp, **split)
    held = _build_stages(arch, pp, split)
    assert [len(stage) for stage in held] == counts
    assert [n for stage in held for n in stage] == list(range(1, arch.num_layers + 1))
    if split:
        with pytest.raises(ValueError, match="do not split"):
            pipeline_stage_layers(arch.num_layers, pp)
        with pytest.raises(AssertionError, match="divisible by pipeline_model_parallel_size"):  # Megatron
            _build_stages(arch, pp, {})


def test_stage_layer_counts_are_megatrons_split():
    from slimish.megatron_bridge.hf_config import pipeline_stage_layers

    assert pipeline_stage_layers(61, 4, first=16) == [16, 15, 15, 15]
    assert pipeline_stage_layers(61, 8, first=5, last=8) == [5, 8, 8, 8, 8, 8, 8, 8]
    assert pipeline_stage_layers(126, 7) == [18] * 7 and pipeline_stage_layers(3, 2, last=2) == [1, 2]
    assert pipeline_stage_layers(64, 4, virtual_pipeline=2) == [16] * 4
    assert pipeline_stage_layers(60, 4, first=14, last=14, virtual_pipeline=2) == [14, 16, 16, 14]
    for args, kwargs in (((61, 4), {}), ((61, 4), {"first": 15}), ((4, 2), {"first": 4}), ((4, 1), {"last": 1}),
                         ((61, 4), {"first": 16, "virtual_pipeline": 2}), ((8, 2), {"virtual_pipeline": 2})):
        with pytest.raises(ValueError):
            pipeline_stage_layers(*args, **kwargs)


# The large-model recipes and their models: each is built at its own layout (recipe_meta_build.py).
RECIPE_MODELS = {"llama31_405b_math_grpo": "llama-3.1-405b", "deepseek_v3_math_grpo": "deepseek-v3",
                 "qwen3_235b_a22b_math_grpo": "qwen3-235b-a22b", "glm45_math_grpo": "glm-4.5"}


@pytest.mark.parametrize("recipe", list(RECIPE_MODELS))
def test_recipe_builds_at_its_layout(recipe, tmp_path):
    """Megatron builds one trainer rank of every pipeline stage of the recipe at the recipe's TP / PP / EP / ETP
    (torch's fake process group standing in for its world; meta device), holding the layers
    `pipeline_stage_layers` gives each stage (check-config and plan use it) and the parameters `slimish plan` counts
    for that rank: what plan's memory figures in the recipe header stand on."""
    import json
    import subprocess
    import sys

    from slimish.config import load_config
    from slimish.megatron_bridge.hf_config import pipeline_stage_layers, read_hf_config
    from slimish.planning.params import count_params
    from tests.conftest import REPO

    model, path = RECIPE_MODELS[recipe], REPO / "configs" / "recipes" / f"{recipe}.yaml"
    out = tmp_path / "stages.json"
    subprocess.run([sys.executable, "-m", "tests.megatron_bridge.recipe_meta_build", str(path), model, str(out)],
                   cwd=REPO, check=True, timeout=600)
    stages = json.loads(out.read_text())
    par = load_config(path, [f"model.hf_path={model}"], files=False).parallel
    hf_config = read_hf_config(model)
    counts = pipeline_stage_layers(hf_config["num_hidden_layers"], par.pipeline_parallel,
                                   first=par.first_stage_layers, last=par.last_stage_layers)
    params = count_params(hf_config)
    assert [len(s["layers"]) for s in stages] == counts
    assert [n for s in stages for n in s["layers"]] == list(range(1, hf_config["num_hidden_layers"] + 1))
    assert [(s["embedding"], s["output_layer"]) for s in stages] == [
        (k == 0, k == par.pipeline_parallel - 1) for k in range(par.pipeline_parallel)]
    planned = [list(params.rank(tensor_parallel=par.tensor_parallel, pipeline_parallel=par.pipeline_parallel,
                                expert_parallel=par.expert_parallel, expert_tensor_parallel=par.expert_tensor_parallel,
                                stage=k, stage_layers=counts)) for k in range(par.pipeline_parallel)]
    assert [s["params"] for s in stages] == planned
