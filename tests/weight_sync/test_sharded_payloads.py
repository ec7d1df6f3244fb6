"""The sharded sync's payloads load into SGLang's own model ranks: for each layout, `EngineShards` cuts a checkpoint
(every weight changed, so that a parameter left out would keep its old value) into per-rank (engine parameter,
tensor) pairs; each rank of an engine, built by SGLang's own loader from the unchanged checkpoint
(tests/weight_sync/sglang_rank.py, no server), takes its own pairs as `load_format="direct"` does (a copy by name,
shape checked); it must then report the checksums `ExpectedChecksums` predicts from the changed HF tensors by the
full path's rule (pinned against SGLang's loaders in test_engine_sharding.py). Each rank receives about 1/t of the
model plus what SGLang replicates, counted here.
~30 s, nearly all of it importing SGLang once."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
from slimish.megatron_bridge.hf_io import HFCheckpoint
from slimish.weight_sync.checksums import EngineSharding, ExpectedChecksums, differing
from slimish.weight_sync.sharding import EngineLayout, EngineShards
from tests.conftest import REPO

# (family, tp, ep, CPU engine, expert slots): dense with q/k/v biases, more ranks than key/value heads (GPU rules),
# MoE under tensor and expert parallelism, GLM-4.5's shared expert fused into the routed ones (GPU rules); the MoE
# layouts also with each expert sent alone into its slot (`engine_loader.slot_name`, loaded by slimish's
# `load_by_name`), in an order no stacked parameter has: the last expert of every layer first.
LAYOUTS = [("qwen3", 2, 1, True, False), ("qwen2", 2, 1, True, False), ("qwen3", 4, 1, False, False),
           ("qwen3_moe", 2, 1, True, False), ("qwen3_moe", 2, 2, True, False), ("glm4_moe", 2, 1, False, False),
           ("qwen3_moe", 2, 1, True, True), ("qwen3_moe", 2, 2, True, True), ("glm4_moe", 2, 1, False, True),
           ("glm4_moe", 2, 1, True, True)]
IDS = [f"{f}-tp{t}-ep{e}-{'cpu' if c else 'gpu'}{'-slots' if s else ''}" for f, t, e, c, s in LAYOUTS]


def changed(checkpoint: HFCheckpoint, *, experts_reversed: bool = False):
    """Every tensor of the checkpoint, plus one: the weights of the next version; with `experts_reversed`, the
    routed experts first, the last expert of every layer leading (as owners' senders may deliver them)."""
    names = checkpoint.names()
    if experts_reversed:
        expert = re.compile(r".+\.mlp\.experts\.(\d+)\..+")
        names = sorted(names, key=lambda n: -int(m.group(1)) if (m := expert.fullmatch(n)) else 1)
    for name in names:
        yield name, checkpoint.get(name) + 1


@pytest.fixture(scope="module")
def loaded(tiny_models, tiny_moe_models, tmp_path_factory) -> dict:
    """(family, tp, ep, cpu, slots) -> {"predicted": per-rank checksums, "held": per-rank checksums SGLang's ranks
    report after the direct load, "sent": the sender's per-rank checksums of the payloads, "payloads",
    "rank_bytes": per-rank payload bytes, "model_bytes": the HF tensors' bytes}."""
    models = {**tiny_models, **tiny_moe_models}
    root = tmp_path_factory.mktemp("payloads")
    cases, keys, out = [], [], {}
    for family, tp, ep, cpu, slots in LAYOUTS:
        sharding = EngineSharding(tp=tp, ep=ep, cpu=cpu)
        arch = architecture_from_hf(read_hf_config(models[family]))
        checkpoint = HFCheckpoint(models[family])
        expected = ExpectedChecksums(arch, torch.float32, sharding)
        for name, tensor in changed(checkpoint):
            expected.add(name, tensor)
        payloads: list[list] = [[] for _ in range(tp)]
        layout = EngineLayout(arch, sharding, expert_slots=slots)
        # With slots, the sender's own prediction (`add_shard`, slot by slot) must equal the full path's.
        sent = ExpectedChecksums(arch, torch.float32, sharding)
        for rank, name, tensor in EngineShards(layout).stream(changed(checkpoint, experts_reversed=slots)):
            payloads[rank].append((name, tensor.contiguous()))
            sent.add_shard(rank, name, tensor)
        model_bytes = sum(t.numel() * t.element_size() for _, t in changed(checkpoint))
        out[(family, tp, ep, cpu, slots)] = {"predicted": expected.result(), "sent": sent.result(),
                                             "model_bytes": model_bytes, "payloads": payloads,
                                             "rank_bytes": [sum(t.numel() * t.element_size() for _, t in p)
                                                            for p in payloads]}
        for rank in range(tp):
            path = root / f"{family}-tp{tp}-ep{ep}-{cpu}-{slots}-{rank}.pt"
            torch.save(payloads[rank], path)
            cases.append({"model": str(models[family]), "tp": tp, "rank": rank, "cpu_padding": cpu,
                          "args": ["--ep-size", str(ep)] if ep > 1 else [], "direct": str(path),
                          **({"loader": "by_name"} if slots else {})})
            keys.append(((family, tp, ep, cpu, slots), rank))
    result = subprocess.run([sys.executable, "-m", "tests.weight_sync.sglang_rank", json.dumps(cases)],
                            capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    for (key, rank), case in zip(keys, json.loads(result.stdout.strip().splitlines()[-1])):
        out[key].setdefault("held", {})[rank] = case["checksums"]
    return out


@pytest.mark.parametrize(("family", "tp", "ep", "cpu", "slots"), LAYOUTS, ids=IDS)
def test_each_rank_loads_its_own_payload_by_name(loaded, family, tp, ep, cpu, slots):
    case = loaded[(family, tp, ep, cpu, slots)]
    for rank in range(tp):
        assert differing(case["predicted"][rank], case["held"][rank]) == [], \
            f"{family} (tp {tp}, ep {ep}) rank {rank}: the direct load of its payload holds other values"
        assert differing(case["predicted"][rank], case["sent"][rank]) == [], \
            f"{family} (tp {tp}, ep {ep}) rank {rank}: the sender's checksums of its payload are not the full path's"
        slot_names = [name for name, _ in case["payloads"][rank] if name.endswith("]")]
        assert bool(slot_names) == slots, f"rank {rank}: expert slots {slot_names[:3]}"
        assert not any(name.endswith(("w13_weight", "w2_weight")) for name, _ in case["payloads"][rank]) or not slots


@pytest.mark.parametrize(("family", "tp", "ep", "cpu", "slots"), LAYOUTS, ids=IDS)
def test_each_rank_receives_about_its_share(loaded, family, tp, ep, cpu, slots):
    """A rank's payload is its 1/t of the split tensors plus the replicated ones (norms, routers, and padding on
    the CPU): more than 1/t of the model and well under all of it."""
    case = loaded[(family, tp, ep, cpu, slots)]
    share = case["model_bytes"] / tp
    ceiling = 0.75 if tp == 2 else 0.5
    for rank, rank_bytes in enumerate(case["rank_bytes"]):
        assert share <= rank_bytes < ceiling * case["model_bytes"], \
            f"rank {rank}: {rank_bytes} bytes of a {case['model_bytes']}-byte model"


def test_mla_loads_by_name_with_slimishs_loader_and_its_derived_buffers_follow(tiny_moe_models, tmp_path):
    """DeepSeek-V3 (MLA) at TP2 on CPU: each rank's payload loaded by slimish's `load_by_name` holds what SGLang's own
    loader makes of the changed checkpoint, parameters and the `w_kc` / `w_vc` it derives from kv_b_proj; SGLang's
    stock `direct` copy leaves those stale (why MLA needs the loader). ~15 s more."""
    from safetensors.torch import save_file

    from tests.weight_sync.test_engine_sharding import served

    model = served(tiny_moe_models["deepseek_v3"])
    changed_dir = tmp_path / "changed"
    changed_dir.mkdir()
    for item in model.iterdir():
        if item.suffix != ".safetensors":
            (changed_dir / item.name).symlink_to(item.resolve())
    checkpoint = HFCheckpoint(model)
    save_file({name: t.contiguous() for name, t in changed(checkpoint)}, str(changed_dir / "model.safetensors"))
    arch = architecture_from_hf(read_hf_config(model))
    payloads: list[list] = [[], []]
    for rank, name, tensor in EngineShards(EngineLayout(arch, EngineSharding(tp=2, cpu=True))).stream(
            changed(checkpoint)):
        payloads[rank].append((name, tensor.contiguous()))
    cases = []
    for rank in range(2):
        torch.save(payloads[rank], tmp_path / f"rank{rank}.pt")
        cases += [{"model": str(changed_dir), "tp": 2, "rank": rank},
                  {"model": str(model), "tp": 2, "rank": rank, "direct": str(tmp_path / f"rank{rank}.pt"),
                   "loader": "by_name"},
                  {"model": str(model), "tp": 2, "rank": rank, "direct": str(tmp_path / f"rank{rank}.pt")}]
    result = subprocess.run([sys.executable, "-m", "tests.weight_sync.sglang_rank", json.dumps(cases)],
                            capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for rank in range(2):
        loaded, by_name, stock = out[3 * rank:3 * rank + 3]
        assert loaded["derived"], "the tiny DeepSeek-V3 has MLA layers with w_kc / w_vc"
        assert differing(loaded["checksums"], by_name["checksums"]) == [], f"rank {rank}"
        assert by_name["derived"] == loaded["derived"], f"rank {rank}: w_kc / w_vc not re-derived"
        assert stock["derived"] != loaded["derived"], f"rank {rank}: the stock direct copy re-derived them too"
