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
from slimish.weight_sync.checksums import EngineSharding, ExpectedChecksums, differing
from tests.conftest import REPO

# (family, tp, ep, CPU padding): every rank of each.
LAYOUTS = [("qwen3", 2, 1, True), ("qwen2", 2, 1, True), ("qwen3_moe", 2, 1, True), ("qwen3_moe", 2, 2, True),
           ("glm4_moe", 2, 1, True), ("qwen3", 4, 1, False), ("glm4_moe", 2, 1, False)]


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory) -> dict[str, Path]:
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("moe")
    return {**tiny_models, **{family: build_tiny_model(root / family, corpus=echo_digit.corpus(), family=family)
                              for family in ("qwen3_moe", "glm4_moe")}}


@pytest.fixture(scope="module")
def sglang_ranks(models) -> dict[tuple, dict[str, str]]:
    """(family, tp, ep, cpu padding, rank) -> SGLang's checksums of that rank."""
    cases, keys = [], []
    for family, tp, ep, cpu in LAYOUTS:
        for rank in range(tp):
            cases.append({"model": str(models[family]), "tp": tp, "rank": rank, "cpu_padding": cpu,
                          "args": ["--ep-size", str(ep)] if ep > 1 else []})
            keys.append((family, tp, ep, cpu, rank))
    result = subprocess.run([sys.executable, "-m", "tests.weight_sync.sglang_rank", json.dumps(cases)],
                            capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return dict(zip(keys, json.loads(result.stdout.strip().splitlines()[-1])))


@pytest.mark.parametrize(("family", "tp", "ep", "cpu"), LAYOUTS,
                         ids=[f"{f}-tp{t}-ep{e}-{'cpu' if c else 'gpu'}" for f, t, e, c in LAYOUTS])
def test_every_rank_holds_what_the_sender_predicts(models, sglang_ranks, family, tp, ep, cpu):
    model = models[family]
    expected = ExpectedChecksums(architecture_from_hf(read_hf_config(model)), torch.float32,
                                 EngineSharding(tp=tp, ep=ep, cpu=cpu))
    checkpoint = HFCheckpoint(model)
    for name in checkpoint.names():
        expected.add(name, checkpoint.get(name))
    predicted = expected.result()
    for rank in range(tp):
        held = sglang_ranks[(family, tp, ep, cpu, rank)]
        assert differing(predicted[rank], held) == [], \
            f"SGLang shards {family} (tp {tp}, ep {ep}, {'CPU' if cpu else 'GPU'} rules) rank {rank} otherwise"
