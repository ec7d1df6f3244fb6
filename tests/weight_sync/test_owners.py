"""Experts straight from the trainer ranks that own them (`slimish.weight_sync.owners`): a tiny Qwen3-MoE trained at
expert parallelism 2 (two gloo ranks; attention data-parallel, and tensor-parallel over both ranks, which then
share rank 0's gathers) syncs to a stand-in TP2 EP2 engine (tests/weight_sync/owners_rank.py) through rank 0 (the
funnel) and from the owners, over `tensor` (the owner's own shared segments, mapped by the stand-in in rank 0's
process) and `disk` (the owner's own files). Both routes deliver the same tensors to each engine rank, verified
against the trainer's per-rank checksums; from the owners, EP rank 1 stages exactly its own experts' bytes and rank
0 none of them. Engines frozen or killed inside an owner's broadcast release both senders. ~50 s for the file, most of
it the first world's imports (run_world keeps its processes warm); the frozen / killed test 17 s, ~6 of them its
two faults."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multiproc import run_world

SCRIPT = Path(__file__).with_name("owners_rank.py")


def run(models, tmp_path, tp: int, transport: str, *faults: str, etp: int = 1, ep: int = 2, pp: int = 1,
        engine_ep: int = 2, verify: bool = True, device: str = "cpu") -> dict:
    run_world(SCRIPT, world_size=pp * max(ep, tp, ep * etp),
              args=["--tp", str(tp), "--etp", str(etp), "--ep", str(ep), "--pp", str(pp),
                    "--model", str(models["qwen3_moe"]), "--out", str(tmp_path), "--transport", transport,
                    "--engine-ep", str(engine_ep), *([] if verify else ["--no-verify"]), "--engine-device", device,
                    "--faults", *faults])
    return torch.load(tmp_path / "result.pt")


def assert_same_held(result: dict, route: str) -> None:
    for rank in range(2):
        held, funnel = result[route]["held"][rank], result["funnel"]["held"][rank]
        assert held.keys() == funnel.keys(), f"{route}: engine rank {rank}"
        for name, tensor in funnel.items():
            assert torch.equal(tensor, held[name]), f"{route}: engine rank {rank}: {name}"


def owned_by_ep1(name: str, rank: int, slots_per_rank: int, engine_ep: int, num_experts: int) -> bool:
    """Whether expert slot `name` of engine rank `rank` (of two) is one of trainer EP rank 1's experts (the upper
    half): engine EP2 gives rank r expert block r, EP1 every expert to both ranks."""
    index = int(name.rsplit("[", 1)[1].rstrip("]"))
    block = rank if engine_ep == 2 else 0
    return block * slots_per_rank + index >= num_experts // 2


@pytest.mark.parametrize(("tp", "etp", "transport", "engine_ep", "verify", "device"), [
    (2, 1, "tensor", 2, True, "cpu"), (1, 1, "disk", 2, True, "cpu"), (2, 2, "tensor", 2, True, "cpu"),
    (2, 1, "tensor", 1, False, "cpu"), (2, 1, "tensor", 1, True, "cpu"), (2, 1, "tensor", 1, True, "cuda"),
    (2, 1, "broadcast", 2, True, "cpu")],
    ids=["tp2-tensor", "dp2-disk", "tp2-etp2-tensor", "engine-ep1-unverified", "engine-ep1-verified-funnel",
         "engine-ep1-verified-tile-hash", "tp2-broadcast"])
def test_each_owner_sends_its_own_experts(tiny_moe_models, tmp_path, tp, etp, transport, engine_ep, verify, device):
    """tp2-etp2: four ranks, each expert split over two (ETP2): the owner of EP rank 1 (rank 2) gathers its experts
    from its ETP peer between its buckets. engine-ep1: each engine rank holds a slice of every expert, so each of its
    stacked parameters gets slots from both owners: taken without checksums (verify off); with them, on CPU engines
    (SHA-256) left to the funnel (an owner cannot hash another's slots), on CUDA engines (the stand-in reporting the
    tile hash) taken, each owner's partial hash of its slots combined on rank 0, and an engine holding a changed
    slot fails the sync naming the parameter and the rank (the next sync, on a new connection, delivers).
    The tile-hash case: ~1.5 s more (four syncs, in warm processes)."""
    faults = ("corrupt",) if device == "cuda" else ()
    result = run(tiny_moe_models, tmp_path, tp, transport, *faults, etp=etp, engine_ep=engine_ep, verify=verify,
                 device=device)
    if faults:
        failed = result["corrupt"]["failed"]
        assert "tensor-parallel rank 1" in failed and "model.layers.0.mlp.experts.w13_weight" in failed, failed
        assert "1 parameter(s)" in failed, failed
        for rank in range(2):
            held, funnel = result["corrupt"]["held"][rank], result["funnel"]["held"][rank]
            assert held.keys() == funnel.keys() and all(torch.equal(held[n], funnel[n]) for n in held)
        assert result["corrupt"]["metrics"]["sync_senders"] == 2
    funnel, owners = result["funnel"], result["owners"]
    for rank in range(2):
        assert funnel["held"][rank].keys() == owners["held"][rank].keys(), f"engine rank {rank}"
        for name, tensor in funnel["held"][rank].items():
            assert torch.equal(tensor, owners["held"][rank][name]), f"engine rank {rank}: {name}"
    slots = [[name for name in owners["held"][rank] if name.endswith("]")] for rank in range(2)]
    assert slots[0] and slots[1]
    per_rank = len({name.rsplit("[", 1)[1] for name in slots[0]})
    num_experts = per_rank * engine_ep
    expert_bytes = sum(t.numel() * t.element_size() for rank in range(2) for name, t in owners["held"][rank].items()
                       if name.endswith("]") and owned_by_ep1(name, rank, per_rank, engine_ep, num_experts))
    f, o = funnel["metrics"], owners["metrics"]
    for metrics in (f, o):
        assert metrics["sync_checksums_predicted"] == int(verify) and metrics["sync_sharded"] == 1
    owner = etp  # EP rank 1's ETP rank 0 (Megatron numbers the experts' ranks ETP first)
    assert f"sync_sent_rank{owner}_mib" not in f and f["sync_sent_rank0_mib"] == pytest.approx(f["sync_mib"])
    assert o["sync_mib"] == pytest.approx(f["sync_mib"])
    if engine_ep == 1 and verify and device == "cpu":  # outside owners_fit (SHA-256): through rank 0
        assert f"sync_sent_rank{owner}_mib" not in o and o["sync_senders"] == 1
        return
    assert o[f"sync_sent_rank{owner}_mib"] == pytest.approx(expert_bytes / 2**20)  # the owner's experts, all of them
    assert o["sync_sent_rank0_mib"] == pytest.approx(f["sync_sent_rank0_mib"] - expert_bytes / 2**20)
    assert o["sync_senders"] == 2 and f["sync_senders"] == 1
    assert not [p for p in tmp_path.rglob("*.safetensors")], "shards left behind (the owner's are rank 0's to remove)"
    print(f"{transport}: funnel rank 0 {f['sync_sent_rank0_mib']:.4f} MiB; owners rank 0 "
          f"{o['sync_sent_rank0_mib']:.4f} MiB, rank {owner} {o[f'sync_sent_rank{owner}_mib']:.4f} MiB")


@pytest.mark.parametrize("transport", ["tensor", "broadcast"])
def test_a_sync_that_fails_releases_the_owners_and_the_next_one_delivers(tiny_moe_models, tmp_path, transport):
    """The engine fails one of rank 0's own buckets (rank 0 finishes its export, whose gathers the owner shares at
    TP2, then tells the owner to give up at its first bucket), or one of the owner's (rank 0 answers it False): the
    sync fails on rank 0 only, no rank hangs, and the next sync, on a new connection, delivers every tensor. A connect
    failing on rank 0 (engines of another TP size) is raised there; the owner returns.
    broadcast: the engine's rank 1 fails the request before it joins its group (as a rank that died would); its rank
    0 joins and waits. The sender of the bucket (rank 0, or the owner on its own group) gives up the join within the
    bucket's deadline (5 s here) and destroys the group rank 0 joined, which ends that rank's receive; rank 0 then
    fails the sync and, for the owner's bucket, tells the owner to give up. Rank 0 raises the engine's error, or the
    bucket's deadline if that passes first (for the owner's bucket the two are ~5 s apart: either may come first)."""
    result = run(tiny_moe_models, tmp_path, 2, transport, "first", "owner", "tp")
    # Engines of another TP size: rank 0 raises naming the key at connect, the owner returns (no one hangs).
    assert "rollout.engine.tensor_parallel" in result["tp"]["failed"]
    assert torch.load(tmp_path / "tp_rank1.pt") == {"failed": {}}
    for fault in ("first", "owner"):
        failed = result[fault]["failed"]
        assert "this bucket fails" in failed or (transport == "broadcast" and "by its deadline" in failed), fault
        for rank in range(2):
            held, funnel = result[fault]["held"][rank], result["funnel"]["held"][rank]
            assert held.keys() == funnel.keys() and all(torch.equal(held[n], funnel[n]) for n in held), fault
        assert result[fault]["metrics"]["sync_checksums_predicted"] == 1


@pytest.mark.parametrize(("tp", "ep", "transport", "senders"), [
    (1, 1, "disk", {0, 1}), (1, 2, "broadcast", {0, 1, 2, 3}), (2, 2, "tensor", {0, 1, 2, 3})],
    ids=["pp2-stages-disk", "pp2-ep2-broadcast", "pp2-tp2-ep2-tensor"])
def test_each_stage_sends_its_own_layers_and_each_owner_its_experts(tiny_moe_models, tmp_path, tp, ep, transport,
                                                                     senders):
    """Pipeline parallelism 2 (a tiny Qwen3-MoE of two layers, one per stage): without expert parallelism the
    second stage's only rank sends its whole stage (the "stages" route, its experts included); with EP2 each stage's
    leader sends its stage outside the experts and each EP rank its own experts (four senders), nothing crossing the
    pipeline group; over broadcast in rounds (fewer requests than buckets). At TP2 the second stage's owner (rank 3)
    shares its leader's (rank 2) TP gathers, and with 0.02 MiB buckets the leader sends several buckets of them: rank
    0 waits for rank 3's first bucket only once rank 2 has passed them (`OwnerLink.ready`), else the three would wait
    on each other (with 4 KiB buckets they did). The engine ranks end with what the route through rank 0 gives them,
    verified against the trainer's checksums. At TP2 one of rank 0's buckets fails, then one of an owner's: the
    senders of both stages give up (a later stage's leader before its owner), and the next sync on a new connection
    delivers. (The broadcast's failures are test_a_sync_that_fails_releases_the_owners_and_the_next_one_delivers's.)"""
    faults = ("first", "owner") if tp == 2 else ()
    result = run(tiny_moe_models, tmp_path, tp, transport, *faults, ep=ep, pp=2)
    assert_same_held(result, "owners")
    f, o = result["funnel"]["metrics"], result["owners"]["metrics"]
    assert f["sync_senders"] == 1 and o["sync_senders"] == len(senders)
    assert {int(key.removeprefix("sync_sent_rank").removesuffix("_mib")) for key in o
            if key.startswith("sync_sent_rank")} == senders
    assert sum(v for k, v in o.items() if k.startswith("sync_sent_rank")) == pytest.approx(f["sync_mib"])
    assert o["sync_sent_rank0_mib"] < f["sync_sent_rank0_mib"] / 2  # stage 1, and EP rank 1's experts, elsewhere
    assert o["sync_checksums_predicted"] == 1 and o["sync_sharded"] == 1
    if transport == "broadcast":  # rounds: one request names every sender's next bucket
        assert o["sync_requests"] < o["sync_buckets"] and f["sync_requests"] == f["sync_buckets"], o
    for fault in faults:
        assert "this bucket fails" in result[fault]["failed"] or "by its deadline" in result[fault]["failed"], fault
        assert_same_held(result, fault)
    assert not [p for p in tmp_path.rglob("*.safetensors")], "shards left behind"


def test_an_engine_frozen_or_killed_inside_an_owners_broadcast_releases_both_senders(tiny_moe_models, tmp_path):
    """broadcast: engine rank 1 joins the owner's group for the owner's first bucket, then freezes (stops itself) or
    is killed; the stand-in's watchdog then releases the sync (`WeightSender.release`, as the job's does). Rank 0
    fails with an error naming the engine and tells the owner to give up: neither rank hangs (the world ends), and
    the next sync, on a new connection to the restarted engine, delivers every tensor. Ordered by the frozen or dying
    rank's own report and by waiting for its exit, not by sleeps."""
    result = run(tiny_moe_models, tmp_path, 2, "broadcast", "frozen", "killed")
    for fault, word in (("frozen", "froze"), ("killed", "")):
        failed = result[fault]["failed"]
        assert "http://127.0.0.1:1" in failed and word in failed, (fault, failed)
        for rank in range(2):
            held, funnel = result[fault]["held"][rank], result["funnel"]["held"][rank]
            assert held.keys() == funnel.keys() and all(torch.equal(held[n], funnel[n]) for n in held), fault
        assert result[fault]["metrics"]["sync_checksums_predicted"] == 1
    print({fault: result[fault]["failed"] for fault in ("frozen", "killed")})
