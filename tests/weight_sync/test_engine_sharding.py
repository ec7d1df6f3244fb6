"""A pin on the sharding SGLang applies to an engine's parameters: the checksums `ExpectedChecksums` predicts for
every rank of an engine of several tensor-parallel ranks are those SGLang's own model and loaders give that rank
(tests/weight_sync/sglang_rank.py builds it in a subprocess, without an engine, from the same HF checkpoint). If a
new SGLang splits, fuses or pads a parameter differently, this fails naming the family, the layout and the
parameters, before any sync's verification does.

Covered: dense with and without q/k/v biases, two MoE families (routed and shared experts, the router's bias), on
CPU engines (SGLang pads MLP widths there: the tiny MoE's 32-wide experts become 64, all of rank 1's half zeros) and
with the GPU's rules (no padding; more ranks than key/value heads, which then repeat), and expert parallelism.
~25 s, nearly all of it importing SGLang once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
from slimish.megatron_bridge.hf_io import HFCheckpoint
from slimish.weight_sync.checksums import EngineSharding, ExpectedChecksums, differing, fuses_shared_experts
from tests.conftest import REPO

# (family, tp, ep, CPU padding): every rank of each.
# (family, tp, ep, CPU engine, shared-experts fusion): every rank of each. With the GPU's rules, GLM-4.5 fuses its
# shared expert into the routed ones unless expert parallelism is on; DeepSeek-V3 only at its real shape (256
# routed experts) or when forced.
LAYOUTS = [("qwen3", 2, 1, True, "auto"), ("qwen2", 2, 1, True, "auto"), ("qwen3_moe", 2, 1, True, "auto"),
           ("qwen3_moe", 2, 2, True, "auto"), ("glm4_moe", 2, 1, True, "auto"), ("qwen3", 4, 1, False, "auto"),
           ("glm4_moe", 2, 1, False, "auto"), ("glm4_moe", 2, 2, False, "auto"), ("glm4_moe", 2, 1, False, "off"),
           ("deepseek_v3", 2, 1, True, "auto"), ("deepseek_v3", 4, 1, False, "auto"),
           ("deepseek_v3", 2, 1, False, "forced"), ("deepseek_v3_full_q", 2, 1, False, "auto")]
FUSION_ARGS = {"auto": [], "off": ["--disable-shared-experts-fusion"], "forced": ["--enforce-shared-experts-fusion"]}
# What the real DeepSeek-V3 config.json has and the tiny one (written by transformers) lacks, which SGLang's model
# needs to be built: its MoE fields, and its YaRN RoPE (SGLang's CPU MLA knows no other). Weights are unchanged.
DEEPSEEK_V3_FIELDS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                      "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                          "original_max_position_embeddings": 4096, "beta_fast": 32,
                                          "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory) -> dict[str, Path]:
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("moe")
    built = {family: build_tiny_model(root / family, corpus=echo_digit.corpus(), family=family)
             for family in ("qwen3_moe", "glm4_moe", "deepseek_v3")}
    # MLA without a query LoRA (DeepSeek-V2-Lite's): one full-rank q_proj, kv_a_proj_with_mqa alone.
    built["deepseek_v3_full_q"] = build_tiny_model(root / "deepseek_v3_full_q", corpus=echo_digit.corpus(),
                                                   family="deepseek_v3", q_lora_rank=None)
    return {**tiny_models, **built}


def served(model: Path) -> Path:
    """The checkpoint SGLang is given: a DeepSeek-V3's with the fields of DEEPSEEK_V3_FIELDS (the same weights)."""
    config = json.loads((model / "config.json").read_text())
    if config["model_type"] != "deepseek_v3":
        return model
    copy = model.with_name(model.name + "_sglang")
    if not copy.exists():
        copy.mkdir()
        for item in model.iterdir():
            (copy / item.name).symlink_to(item)
        (copy / "config.json").unlink()
        (copy / "config.json").write_text(json.dumps({**config, **DEEPSEEK_V3_FIELDS}))
    return copy


@pytest.fixture(scope="module")
def sglang_ranks(models) -> dict[tuple, dict[str, str]]:
    """(family, tp, ep, CPU engine, fusion, rank) -> {"checksums": SGLang's checksums of that rank, "server_info":
    what the engine's /server_info would say of its sharding}."""
    cases, keys = [], []
    for family, tp, ep, cpu, fusion in LAYOUTS:
        for rank in range(tp):
            args = (["--ep-size", str(ep)] if ep > 1 else []) + FUSION_ARGS[fusion]
            cases.append({"model": str(served(models[family])), "tp": tp, "rank": rank, "cpu_padding": cpu,
                          "args": args})
            keys.append((family, tp, ep, cpu, fusion, rank))
    result = subprocess.run([sys.executable, "-m", "tests.weight_sync.sglang_rank", json.dumps(cases)],
                            capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return dict(zip(keys, json.loads(result.stdout.strip().splitlines()[-1])))


@pytest.mark.parametrize(("family", "tp", "ep", "cpu", "fusion"), LAYOUTS,
                         ids=[f"{f}-tp{t}-ep{e}-{'cpu' if c else 'gpu'}-fusion_{u}" for f, t, e, c, u in LAYOUTS])
def test_every_rank_holds_what_the_sender_predicts(models, sglang_ranks, family, tp, ep, cpu, fusion):
    model = models[family]
    sharding = EngineSharding(tp=tp, ep=ep, cpu=cpu, shared_experts_fusion=fusion)
    arch = architecture_from_hf(read_hf_config(model))
    expected = ExpectedChecksums(arch, torch.float32, sharding)
    checkpoint = HFCheckpoint(model)
    for name in checkpoint.names():
        expected.add(name, checkpoint.get(name))
    predicted = expected.result()
    shared = arch.moe is not None and bool(arch.moe.shared_ffn_hidden_size)
    fused = fuses_shared_experts(arch, sharding)
    for rank in range(tp):
        held = sglang_ranks[(family, tp, ep, cpu, fusion, rank)]["checksums"]
        if shared:
            assert fused != any(".shared_experts." in name for name in held), \
                f"SGLang {'does not fuse' if fused else 'fuses'} {family}'s shared experts here"
        assert differing(predicted[rank], held) == [], \
            f"SGLang shards {family} (tp {tp}, ep {ep}, {'CPU' if cpu else 'GPU'} rules) rank {rank} otherwise"


# What EngineSharding.of_server reads of an engine's /server_info (SGLang's ServerArgs.resolved_dict()).
SERVER_INFO_FIELDS = {"tp_size", "ep_size", "attn_dp_size", "device", "disable_shared_experts_fusion",
                      "enforce_shared_experts_fusion", "moe_a2a_backend", "enable_two_batch_overlap",
                      "enable_single_batch_overlap"}
SERVER_INFO_CASES = [("glm4_moe", 2, 2, False, "auto"), ("glm4_moe", 2, 1, False, "off"),
                     ("deepseek_v3", 2, 1, False, "forced")]


@pytest.mark.parametrize(("family", "tp", "ep", "cpu", "fusion"), SERVER_INFO_CASES,
                         ids=["ep2", "fusion_off", "fusion_forced"])
def test_the_sharding_is_read_from_fields_sglang_reports(sglang_ranks, family, tp, ep, cpu, fusion):
    """EngineSharding.of_server reads fields /server_info has (SGLang's resolved arguments), under their names."""
    info = sglang_ranks[(family, tp, ep, cpu, fusion, 0)]["server_info"]
    assert SERVER_INFO_FIELDS <= set(info), f"/server_info lacks {SERVER_INFO_FIELDS - set(info)}"
    sharding = EngineSharding.of_server(info)
    assert (sharding.tp, sharding.ep, sharding.shared_experts_fusion) == (tp, ep, fusion)
