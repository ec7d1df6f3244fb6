"""A weight sync writes every parameter of a real SGLang engine, for a dense family on an engine of one rank and an
MoE family on an engine of two tensor-parallel ranks, with every transport; the checksums the sender predicts are
the engine's, on every rank; and a bucket corrupted on its way is caught by the sync's own verification, naming the
tensor.

With SGLang's `/weights_checker`: per-parameter checksums of the engine as it loaded the model from disk ->
`reset_tensors` (every parameter random) -> sync the same checkpoint's tensors through `slimish.weight_sync` -> every
checksum must be back. A parameter the sync missed keeps its random values. (Its `snapshot` / `compare` actions
would do the same, but `compare` moves tensors to CUDA: not on CPU.) No trainer: the HF tensors come from the
checkpoint, as `export_full_hf_tensors` gives them (tested against it in tests/megatron_bridge).

Last, an RL job with an expert-parallel trainer attaches to the GLM-4.5 engine: the whole path, Megatron's export
of a mixture of experts to the engine's two ranks, with logprob parity after each sync.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from slimish.network import auth_headers
from tests.conftest import free_port

# Dense and MoE. MLA (DeepSeek-V3) is not here: SGLang 0.5.23 cannot serve the tiny MLA model on CPU (its
# torch_native attention fails in MLA prefill: "Expected size for first two dimensions of batch2 tensor to be:
# [4, 24] but got: [4, 32]"; its CPU rotary path also needs rope scaling and config.json fields transformers drops).
# glm4_moe runs on an engine of tensor-parallel size 2: each rank holds its shard of the fused q/k/v (with biases),
# gate/up, experts and shared experts, of the padded vocabulary (the sync's checksums are predicted per rank).
FAMILIES = ["qwen3", "glm4_moe"]
ENGINE_TP = {"qwen3": 1, "glm4_moe": 2}


KEYS: dict[str, str | None] = {}  # engine URL -> the key it requires (the shared engines have one)


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    """One engine of two tensor-parallel ranks on a tiny GLM-4.5, started as tests/e2e/shared_engines.py starts
    engines to attach to (with a key): the weight-sync tests of glm4_moe use it, and so does the MoE RL job, which
    attaches to it (an engine start saved)."""
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model
    from tests.e2e import shared_engines

    root = tmp_path_factory.mktemp("engine_glm4_moe")
    model = build_tiny_model(root / "model", corpus=echo_digit.corpus(), family="glm4_moe")
    engines = shared_engines.start(str(model), root, count=1, tp=ENGINE_TP["glm4_moe"], seed=0,
                                   max_total_tokens=1024)
    yield engines
    engines.stop()


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, tmp_path_factory):
    """(family, engine URL, HF-named tensors of the checkpoint it loaded, a directory whose `model` is that
    checkpoint, its architecture): for qwen3 the first of the e2e tier's shared engines (tests/e2e/shared_engines.py),
    for glm4_moe `moe_engine`; each reset to its checkpoint before and after (a job may have trained it)."""
    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.megatron_bridge.hf_io import HFCheckpoint

    family = request.param
    root = tmp_path_factory.mktemp(f"engine_{family}")
    shared = request.getfixturevalue("engine_pool" if family == "qwen3" else "moe_engine")
    url, model = shared.urls[0], Path(shared.model)
    (root / "model").symlink_to(model)
    KEYS[url] = shared.key
    shared.reset(0)
    try:
        ckpt = HFCheckpoint(model)
        arch = architecture_from_hf(read_hf_config(model))
        yield family, url, [(name, ckpt.get(name)) for name in ckpt.names()], root, arch
    finally:  # back to its checkpoint, as the next job attached to it would make it
        shared.reset(0)


def weights_checker(url: str, action: str) -> dict:
    resp = httpx.post(f"{url}/weights_checker", json={"action": action}, timeout=300,
                      headers=auth_headers(KEYS.get(url)))
    assert resp.status_code == 200, resp.text[:2000]
    return resp.json()


def checksums(url: str) -> list[dict[str, str]]:
    """Per tensor-parallel rank, engine parameter name -> checksum of its values on that rank."""
    ranks = weights_checker(url, "checksum")["ranks"]
    assert [r["parallelism_info"][0]["tp_rank"] for r in ranks] == list(range(len(ranks)))
    return [rank["checksums"] for rank in ranks]


def differ(a: list[dict[str, str]], b: list[dict[str, str]]) -> list[str]:
    """'rank r: name' of every parameter whose checksum differs."""
    assert len(a) == len(b) and all(x.keys() == y.keys() for x, y in zip(a, b))
    return sorted(f"rank {r}: {name}" for r, (x, y) in enumerate(zip(a, b)) for name in x if x[name] != y[name])


def sharding(url: str):
    """How the engine at `url` splits its parameters (its /server_info)."""
    from slimish.weight_sync.checksums import sharding_of

    return sharding_of(url, api_key=KEYS.get(url))


def sync(url: str | list[str], tensors, *, transport: str, workdir, version: str, arch=None, in_transit=None,
         sharded: bool = False, slots: bool = False) -> dict:
    """Send `tensors` to the engine (or engines); with `arch`, verified against the checksums predicted from them,
    else each engine against the first. `in_transit` may alter each bucket after the sender hashed it. `sharded`
    (with `arch`): each engine rank is sent only its own parameters (the sharded route); `slots`: experts one at a
    time into their slots (`EngineShards`, slimish's engine loaders)."""
    import functools

    from slimish.weight_sync.checksums import ExpectedChecksums
    from slimish.weight_sync.sender import sync_to
    from slimish.weight_sync.sharding import EngineLayout

    urls = [url] if isinstance(url, str) else url
    layout = sharding(urls[0])
    # Small buckets: the model spans several, so the flip on the last one and the overlap are exercised.
    expected = functools.partial(ExpectedChecksums, arch, torch.float32, layout) if arch else None
    engine_layout = EngineLayout(arch, layout, expert_slots=slots) if sharded or slots else None
    weight_sync = sync_to(urls, transport=transport, group_name=f"test_{transport}_{version}", bucket_bytes=64 << 10,
                          engine_tp=layout.tp, disk_dir=str(workdir / "disk"), api_key=KEYS.get(urls[0]),
                          expected_checksums=expected, layout=engine_layout)
    if in_transit is not None:
        push = weight_sync.transport.push
        weight_sync.transport.push = lambda bucket, version: push(in_transit(bucket), version=version)
    weight_sync.connect()
    try:
        return weight_sync.send(iter(tensors), version=version)
    finally:
        weight_sync.close()


def test_the_sender_predicts_every_engine_checksum(engine):
    """The checksums computed from the HF tensors (fused q/k/v, gate/up, experts; on each rank its shard) are the
    engine's own, for every parameter on every rank, as it loaded them from the checkpoint."""
    from slimish.weight_sync.checksums import ExpectedChecksums, differing

    family, url, tensors, _, arch = engine
    expected = ExpectedChecksums(arch, torch.float32, sharding(url))
    for name, tensor in tensors:
        expected.add(name, tensor)
    predicted, held = expected.result(), checksums(url)
    assert len(predicted) == len(held) == ENGINE_TP[family]
    for rank, (mine, theirs) in enumerate(zip(predicted, held)):
        assert differing(mine, theirs) == [], f"tensor-parallel rank {rank}"


@pytest.mark.parametrize("transport", ["broadcast", "tensor", "disk", "tensor-sharded", "disk-sharded",
                                       "broadcast-sharded", "tensor-slots", "disk-slots", "broadcast-slots"])
def test_a_sync_writes_every_engine_parameter(engine, transport):
    """Every transport writes every parameter; the full path puts the whole model before every engine rank, the
    sharded one (each rank its own parameters, loaded by name: from shared memory with tensor-sharded, from files of
    its own through slimish's engine-side loader with disk-sharded, over a group of its own with the sender through
    the same loader module with broadcast-sharded) about 1 / tp of it on each of the MoE engine's
    two ranks (plus what SGLang replicates: norms, the router, the CPU's padding). `-slots`: sharded, each expert
    sent alone into its slot of the stacked parameters (slimish's loaders on every transport)."""
    family, url, tensors, workdir, arch = engine
    loaded = checksums(url)
    weights_checker(url, "reset_tensors")
    assert len(differ(loaded, checksums(url))) == sum(map(len, loaded)), "reset_tensors changed every parameter"
    name, _, route = transport.partition("-")
    metrics = sync(url, tensors, transport=name, workdir=workdir, version=f"{transport}-1", arch=arch,
                   sharded=route == "sharded", slots=route == "slots")
    assert metrics["sync_buckets"] > 1 and metrics["time_verify_s"] > 0
    assert differ(loaded, checksums(url)) == [], f"{family}/{transport}: parameters the sync did not write"
    model_mib = sum(t.numel() * t.element_size() for _, t in tensors) / 2**20
    received = [metrics[f"sync_engine_rank{r}_mib"] for r in range(ENGINE_TP[family])]
    print(f"{family}/{transport}: model {model_mib:.3f} MiB, per engine rank {[round(r, 3) for r in received]} MiB")
    assert metrics["sync_expert_slots"] == int(route == "slots" and family == "glm4_moe")
    if route == "" or ENGINE_TP[family] == 1:
        assert received == [pytest.approx(metrics["sync_mib"])] * ENGINE_TP[family]
    else:
        assert metrics["sync_sharded"] == 1
        assert all(model_mib / 2 <= r < 0.75 * model_mib for r in received), received


def test_a_bucket_corrupted_on_its_way_fails_the_sync_naming_the_tensor(engine):
    """One tensor altered after the sender hashed it (+1e-3 on every element): the sync's verification fails and
    names the engine parameter that holds it."""
    from slimish.weight_sync.buckets import Bucket
    from slimish.weight_sync.sync import WeightSyncError

    family, url, tensors, workdir, arch = engine
    victim = next(name for name, _ in tensors if name.endswith("layers.1.post_attention_layernorm.weight"))

    def corrupt(bucket):
        return Bucket(names=bucket.names,
                      tensors=[t + 1e-3 if n == victim else t for n, t in zip(bucket.names, bucket.tensors)],
                      nbytes=bucket.nbytes)

    with pytest.raises(WeightSyncError, match=r"1 parameter\(s\): model\.layers\.1\.post_attention_layernorm\.weight$"):
        sync(url, tensors, transport="broadcast", workdir=workdir, version="corrupted", arch=arch, in_transit=corrupt)
    sync(url, tensors, transport="broadcast", workdir=workdir, version="restored", arch=arch)  # as loaded again


def test_the_same_wrong_bytes_on_every_engine_are_caught(attached, tmp_path):
    """Both shared engines sent the same corrupted bucket hold identical wrong values: checking the engines against
    each other (all a sync could do before it predicted the checksums) passes, while the checksums the sender
    predicts from what it sent catch it on each engine."""
    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.megatron_bridge.hf_io import HFCheckpoint
    from slimish.weight_sync.buckets import Bucket
    from slimish.weight_sync.sync import WeightSyncError

    model = Path(attached.model)
    for url in attached.urls:
        KEYS[url] = attached.key
    ckpt = HFCheckpoint(model)
    tensors = [(name, ckpt.get(name)) for name in ckpt.names()]
    victim = "model.layers.0.mlp.down_proj.weight"

    def corrupt(bucket):  # the same bytes for every engine: one bucket, broadcast to all
        return Bucket(names=bucket.names, tensors=[t.flip(0) if n == victim else t
                                                   for n, t in zip(bucket.names, bucket.tensors)],
                      nbytes=bucket.nbytes)

    try:
        sync(attached.urls, tensors, transport="broadcast", workdir=tmp_path, version="same-1", in_transit=corrupt)
        with pytest.raises(WeightSyncError, match=rf"engine {attached.urls[0]} .* 1 parameter\(s\): {victim}$"):
            sync(attached.urls, tensors, transport="broadcast", workdir=tmp_path, version="same-2",
                 arch=architecture_from_hf(read_hf_config(model)), in_transit=corrupt)
        held = [checksums(url) for url in attached.urls]
        assert held[0] == held[1], "both engines hold the same (wrong) values"
    finally:
        for i in range(len(attached.urls)):
            attached.reset(i)


def _stage_sender_process(rank: int, port: int, model: str, url: str, api_key: str | None, rounds: list[str],
                          results) -> None:
    """One of two pipeline-stage leaders (rank 0: stage 0 and the engine protocol; rank 1: stage 1's StageSender),
    syncing `model`'s checkpoint split in two stages once per entry of `rounds`: 'ok', 'stage0_fails' (rank 0's
    own tensors run out with an error after its first bucket) or 'stage1_fails' (the same on stage 1). Each round
    connects anew, as the trainer does after a failed sync. Rank 0 puts each round's outcome in `results`."""
    import functools
    from pathlib import Path

    import torch.distributed as dist

    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.megatron_bridge.hf_io import HFCheckpoint
    from slimish.weight_sync.checksums import ExpectedChecksums
    from slimish.weight_sync.sender import local_context, sync_to
    from slimish.weight_sync.stages import StageLink, StageSender

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ckpt = HFCheckpoint(Path(model))
    arch = architecture_from_hf(read_hf_config(Path(model)))
    names = ckpt.names()
    mine = [n for n in names if (n.startswith("model.layers.1.") or not n.startswith(("model.layers.",
                                                                                       "model.embed")))]
    if rank == 0:
        mine = [n for n in names if n not in mine]
    KEYS[url] = api_key
    layout = sharding(url)
    expected = functools.partial(ExpectedChecksums, arch, torch.float32, layout)

    def tensors(fail: bool):
        for index, name in enumerate(mine):
            if fail and index == len(mine) // 2:
                raise RuntimeError(f"stage {rank} export failed")
            yield name, ckpt.get(name)

    for round_, outcome in enumerate(rounds):
        if rank == 0:
            sender = sync_to([url], transport="broadcast", group_name=f"stages_{round_}_0", bucket_bytes=16 << 10,
                             engine_tp=layout.tp, api_key=api_key, expected_checksums=expected)
            link = StageLink(stage=1, rank=1, group=dist.group.WORLD, group_name=f"stages_{round_}_1")
        else:
            context = local_context(f"stages_{round_}_1", engine_tp=layout.tp, api_key=api_key)
            sender = StageSender(stage=1, context=context, engine_urls=[url], bucket_bytes=16 << 10, coordinator=0,
                                 group=dist.group.WORLD, expected_checksums=expected)
        for turn in range(2):  # one group at a time, as the trainer connects them
            if turn == rank:
                sender.connect()
            dist.barrier()
        stream = tensors(fail=outcome == f"stage{rank}_fails")
        if rank == 0:
            try:
                results.put(("ok", sender.send(stream, version=f"stages-{round_}", stages=[link])))
            except Exception as exc:  # noqa: BLE001 - the outcome is the test's to judge
                results.put(("failed", f"{type(exc).__name__}: {exc}"))
        else:
            sender.send(stream)  # reports a failure to rank 0 rather than raising it
        sender.close()
        dist.barrier()
    dist.destroy_process_group()


def test_stage_senders_write_every_engine_parameter_and_survive_a_failing_stage(engine):
    """Two pipeline stages, each broadcasting its own layers on its own group while rank 0 posts the engine's
    requests (`slimish.weight_sync.stages`): after a sync every engine parameter is back (reset_tensors first), and
    verification passes with checksums from both stages. A stage whose export fails mid-sync (either stage) fails the
    sync, naming the stage, without leaving the engine or the other stage stuck: the next sync, on new groups,
    succeeds."""
    import multiprocessing

    family, url, tensors, workdir, arch = engine
    loaded = checksums(url)
    weights_checker(url, "reset_tensors")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    rounds = ["ok", "stage1_fails", "stage0_fails", "ok"]
    port = free_port()
    procs = [ctx.Process(target=_stage_sender_process,
                         args=(rank, port, str(workdir / "model"), url, KEYS.get(url), rounds, results))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=600) for _ in rounds]
    for proc in procs:
        proc.join(timeout=120)
        assert proc.exitcode == 0
    (first, metrics), (second, why1), (third, why0), (last, final) = outcomes
    assert first == "ok" and metrics["sync_senders"] == 2 and metrics["time_wire_stage1_s"] > 0, outcomes[0]
    assert metrics["sync_buckets"] > 2
    assert second == "failed" and "pipeline stage 1" in why1 and "stage 1 export failed" in why1, why1
    assert third == "failed" and "stage 0 export failed" in why0, why0
    assert last == "ok", final
    assert differ(loaded, checksums(url)) == [], f"{family}: parameters the stage senders did not write"


@pytest.mark.parametrize("route", ["rank0", "owners", "owners-broadcast"])
def test_two_rl_steps_with_expert_parallel_moe(task_assets, moe_engine, tmp_path, route):
    """RL with the tiny GLM-4.5 (sigmoid router with correction bias, shared expert, first dense layer, partial
    rotary) trained at expert parallelism 2 (two Megatron ranks, each holding half the experts), rolled out by
    `moe_engine` (two tensor-parallel ranks). After every weight sync the engine's logprobs equal the trainer's and
    each rank's checksums the trainer's prediction: the full export gathered every expert, the router bias and the
    shared expert under the names SGLang loads, and the sender cut them into each engine rank's shard (the sharded
    route, weight_sync.sharded auto with a TP2 engine and the tensor transport). `owners`: without checksums
    (weight_sync.verify off: the engine's ranks each hold a slice of every expert, outside what an owner can
    predict), EP rank 1 stages its own experts for the engine, which maps them from its memory (~33 s more);
    `owners-broadcast`: the same over the broadcast transport, EP rank 1 broadcasting its experts to each engine rank
    over a group of its own, which the engine's `receive_shard` joins next to rank 0's."""
    import json
    import subprocess

    from tests.e2e.procs import become_subreaper, leftovers, train_command

    become_subreaper()
    cmd = train_command({**task_assets, "model": moe_engine.model}, tmp_path, "sft.steps=2", "rl.num_steps=2",
                        "run.name=moe", "parallel.num_trainer_ranks=2", "parallel.expert_parallel=2",
                        *moe_engine.overrides(), "rollout.prompts_per_step=8", "weight_sync.bucket_mb=0.1",
                        # tensor: the engine maps each bucket from the trainer's memory
                        f"weight_sync.transport={'broadcast' if route == 'owners-broadcast' else 'tensor'}",
                        *(["weight_sync.verify=false"] if route.startswith("owners") else []))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    records = [json.loads(line) for line in (tmp_path / "moe" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    print(f"moe rl ({route}):", [{k: r.get(k) for k in (
        "step", "logprob_abs_diff_max", "ppo_kl", "reward_mean", "sync_mib", "sync_engine_rank0_mib",
        "sync_engine_rank1_mib", "sync_sent_rank0_mib", "sync_sent_rank1_mib", "time_sync_s")} for r in records])
    for record in records:
        assert record["logprob_abs_diff_max"] <= 1e-4, record
        assert record["samples_failed"] == 0
        if route.startswith("owners"):  # EP rank 1 sent its own experts, rank 0 the rest
            assert record["sync_senders"] == 2 and 0 < record["sync_sent_rank1_mib"] < record["sync_mib"], record
            assert record["sync_sent_rank0_mib"] + record["sync_sent_rank1_mib"] == pytest.approx(record["sync_mib"])
        else:
            assert record["sync_checksums_predicted"] == 1, "each engine rank checked against the trainer"
            assert record["sync_senders"] == 1, record
        # weight_sync.sharded auto: each engine rank was sent only its own parameters (about half the model each).
        assert record["sync_sharded"] == 1, record
        assert record["sync_expert_slots"] == 1, record  # each expert alone into its slot (load_by_name)
        halves = [record["sync_engine_rank0_mib"], record["sync_engine_rank1_mib"]]
        assert sum(halves) == pytest.approx(record["sync_mib"]) and max(halves) < 0.75 * record["sync_mib"], record
    assert records[0]["ppo_kl"] == 0.0
    assert not leftovers(), "processes left running after the job"
