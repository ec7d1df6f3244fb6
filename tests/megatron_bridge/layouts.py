"""Run the bridge on a multi-process TP x PP world (bridge_rank.py) and check its results against HF."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from slimish.megatron_bridge.hf_io import HFCheckpoint
from tests.megatron_bridge.parity import record
from tests.multiproc import run_world

RANK_SCRIPT = Path(__file__).with_name("bridge_rank.py")


def run_layout(out: Path, *, tp: int, pp: int, models: dict[str, str], ep: int = 1, etp: int = 0,
               save_dist: Path | None = None) -> dict[str, list[dict]]:
    """Run bridge_rank.py over `models` (name -> "HF_DIR[:DIST_CKPT]") on the smallest world of TP x PP that also
    holds the experts' ETP x EP x PP (`etp` 0: TP; ETP = TP: data parallel = EP); results by name, rank, each with
    the whole-model export too. With `save_dist`, Megatron-Core also saves each model to save_dist/NAME."""
    world = math.lcm(tp, (etp or tp) * ep) * pp
    args = ["--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--etp", str(etp), "--out", str(out), "--full-export"]
    if save_dist is not None:
        args += ["--save-dist", str(save_dist)]
    for name, spec in models.items():
        args += ["--model", f"{name}={spec}"]
    run_world(RANK_SCRIPT, world_size=world, args=args)
    return {name: [torch.load(out / name / f"rank{rank}.pt") for rank in range(world)] for name in models}


def assert_logits_match_hf(results: list[dict], hf: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    last = [r for r in results if r["logits"] is not None]
    assert last, "no rank produced logits"
    with torch.no_grad():
        expected = model(last[0]["tokens"]).logits
    for result in last:
        assert result["logits"].shape == expected.shape
        assert record((result["logits"] - expected).abs().max().item()) <= 1e-5


def assert_export_is_checkpoint(results: list[dict], hf: Path) -> None:
    """The union over stages is the HF checkpoint, bit-exact, each tensor from exactly one stage."""
    ckpt = HFCheckpoint(hf)
    union: dict[str, torch.Tensor] = {}
    for result in results:
        overlap = union.keys() & result["exported"].keys()
        assert not overlap, f"exported by two stages: {sorted(overlap)[:3]}"
        union.update(result["exported"])
    assert set(union) == set(ckpt.names())
    for name, tensor in union.items():
        assert torch.equal(tensor, ckpt.get(name)), name


def assert_full_export_is_checkpoint(results: list[dict], hf: Path) -> None:
    """The whole-model export gives rank 0 (the weight-sync source) the HF checkpoint bit-exact, every tensor exactly
    once, and every other rank nothing."""
    ckpt = HFCheckpoint(hf)
    names = [name for name, _ in results[0]["full"]]
    assert len(names) == len(set(names)), "a tensor was exported twice"
    assert set(names) == set(ckpt.names())
    for name, tensor in results[0]["full"]:
        assert torch.equal(tensor, ckpt.get(name)), name
    for rank, result in enumerate(results[1:], start=1):
        assert result["full"] == [], f"rank {rank} got tensors"


def assert_owned_export_is_checkpoint(results: list[dict], hf: Path) -> None:
    """The owners' export (`export_owned_hf_tensors`) spreads the HF checkpoint bit-exact over the ranks, every tensor
    exactly once: each pipeline stage's leader everything of its stage outside the routed experts, each expert the
    one rank holding it (ETP rank 0 of its EP rank; without expert parallelism the stage's leader); a rank yields
    something exactly where it says it owns (`owns_in_owned_export`)."""
    ckpt = HFCheckpoint(hf)
    names = [name for result in results for name, _ in result["owned"]]
    assert len(names) == len(set(names)), "a tensor was exported twice"
    assert set(names) == set(ckpt.names())
    for rank, result in enumerate(results):
        assert bool(result["owned"]) == result["owns"], f"rank {rank} owns {result['owns']}"
        for name, tensor in result["owned"]:
            assert result["stage_leader"] or ".mlp.experts." in name, f"rank {rank} exported {name}"
            assert torch.equal(tensor, ckpt.get(name)), name
    if results[0]["sizes"]["ep"] > 1:
        assert any(result["owned"] for result in results[1:]), "no expert from its owner"
