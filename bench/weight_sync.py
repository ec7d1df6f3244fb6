"""Benchmark the weight-sync channel against the raw transport, with real SGLang CPU engines.

    python bench/weight_sync.py [--layers 22] [--rounds 3] [--bucket-mb 64 [256 ...]] [--workdir /tmp]
    (or: make bench-sync)

Builds a random Qwen3 of >= 1 GiB in fp32 (a real family's names and shapes; 22 layers of hidden 1024 give 1.1 GiB),
starts 2 SGLang CPU engines on it, and syncs the whole model from this process (the trainer's side: the HF-named
tensors are in memory, so the export phase is ~0 here) with every transport through `slimish.weight_sync`, the code
the trainer runs. The baseline, measured in the same run: one torch.distributed broadcast (gloo, like the
`broadcast` transport on CPU) of the same number of bytes from this process to 2 receiving processes. Per transport
it prints the best of `--rounds` syncs with its per-phase breakdown, then one line each:

    transport=<name> sync_vs_raw_ratio=<x> model_mib=<m> buckets=<n> sync_s=<s> raw_s=<r> bucket_mb=<b>

ratio = raw time / sync time (1.0: the sync is as fast as the bare wire). A sync is timed as a job pays for it,
verification included (the sender's hashes and the engines' /weights_checker checksums: phases `hash` and
`verify`). Each transport runs at every
`--bucket-mb` size; the last line is `broadcast` at the first size given.

The PP2 case: two sender processes stand in for a pipeline-parallel-2 trainer's stage leaders (stage 0: the
embedding and the first half of the layers; stage 1: the rest) and sync with `broadcast`, once through rank 0 (stage
1's tensors travel to rank 0 first: `funnel`) and once with stage senders (`stages`: stage 1 flattens, hashes and
broadcasts its own buckets on its own group, the two taking turns on the wire); it prints both and their ratio.
Engine start-up is excluded. Needs ~10 GB of memory.

    python bench/weight_sync.py --engine-tp 2 [--layers 8] [--rounds 3] [--bucket-mb 64]   (make bench-sync-sharded)

The sharded case: one engine of two tensor-parallel ranks, and per transport (`disk`, `broadcast`, `tensor`) the
whole model to every rank (weight_sync.sharded off) against each rank only its own parameters (on), both
verified; it prints seconds and MiB per engine rank of each, and last:

    transport=<t> sharded_vs_full_ratio=<full s / sharded s> rank_mib_full=<m> rank_mib_sharded=<m> ...

then the calibration of `slimish.weight_sync.estimate.cpu_sync_seconds`: the CPUs other jobs kept busy while the
syncs ran (`OthersBusy`, from /proc: the cores left to the syncs, over all of them and during each), this machine's
rates measured in the same run (`measure_machine`: CPU-seconds of a copy into a reused buffer, into a fresh one and
out of a fresh mapping, SGLang's CPU checksum, a file's copy out of its mapping, a file's write and removal;
seconds of that write and of a raw gloo broadcast to the engine's ranks with the CPUs it keeps busy; an engine
request's seconds and CPU-seconds), per transport and route the measured and estimated seconds (with the cores
other jobs left that sync), bytes per engine rank and CPU-seconds, and last:

    calibration_worst_abs_error=<max |estimated / measured - 1| of the six> ... sharded_vs_full_ratio=<tensor's>
    ... load_average_1min=<l> cores=<the CPUs left to the syncs, over all of them> (all syncs)

    python bench/weight_sync.py --engine-tp 2 --senders 2 [--layers 8] [--rounds 3] [--bucket-mb 64]
    (the second run of make bench-sync-sharded)

The sharded route from two senders: the same TP2 engine, and two processes standing in for a PP2 trainer's stage
leaders (as the PP2 case splits the model). Per transport (`disk`, `tensor`, `broadcast`) the sharded sync from
both (`owned`: stage 1 is an `OwnerSender`, as the trainer's "stages" route makes it, cutting its stage into the
engine ranks' parts and staging them itself while rank 0 posts every request), against the sharded sync from rank 0
alone (`funnel`: stage 1's tensors sent to rank 0 first), and over broadcast against the same two senders posted
one request per bucket (`per_bucket`: `one_request_per_bucket`, a bench emulation; the production default is one
request per round, `BroadcastTransport.push_round`). Per case: seconds (best of `--rounds`), the CPU-seconds of
every process of that sync (`cpu_s`), `sync_requests`, `sync_buckets`, MiB per sender and per engine rank;
then per transport, broadcast last:

    transport=<t> two_senders_vs_funnel_ratio=<funnel s / two senders s> ... [rounds_vs_per_bucket_ratio=<per
    bucket s / rounds s> ...] [wire_model_ratio=<the cluster wire model's funnel / two senders>] load_average_1min=<l>

`wire_model_ratio` is what `slimish.weight_sync.estimate.sync_seconds` predicts for one NIC per sender (a GPU
cluster); the CPU model (`cpu_sync_seconds`) has no several senders, so this run is not checked against it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NUM_ENGINES = 2
TRANSPORTS = ("disk", "tensor", "broadcast")  # broadcast last: its line is the figure


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_model(root: Path, layers: int) -> Path:
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    return build_tiny_model(root / "model", corpus=echo_digit.corpus(), family="qwen3", hidden_size=1024,
                            intermediate_size=3072, num_hidden_layers=layers, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=64)


def load_model(root: Path, layers: int) -> tuple[Path, object, list, int]:
    """Build the bench's model under `root` and read it whole: (its directory, its architecture, its tensors, their
    bytes), announced in one line."""
    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.megatron_bridge.hf_io import HFCheckpoint

    model = build_model(root, layers)
    ckpt = HFCheckpoint(model)
    tensors = [(name, ckpt.get(name)) for name in ckpt.names()]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    print(f"model: qwen3, {layers} layers, {nbytes / 2**20:.0f} MiB fp32, {len(tensors)} tensors", flush=True)
    return model, architecture_from_hf(read_hf_config(model)), tensors, nbytes


def start_engines(model: Path, log_dir: Path, count: int = NUM_ENGINES, tp: int = 1) -> list:
    from slimish.engines.process import ManagedProcess
    from slimish.engines.server import engine_argv, engine_env

    engines = []
    for i in range(count):
        port = free_port()
        argv = engine_argv(model_path=str(model), host="127.0.0.1", port=port, device="cpu", dtype="float32", tp=tp,
                           max_total_tokens=1024, seed=i, extra=[])
        proc = ManagedProcess(f"engine{i}", argv, env=engine_env(tp), log_path=log_dir / f"engine{i}.log")
        proc.start()
        engines.append((proc, f"http://127.0.0.1:{port}"))
    for proc, url in engines:
        proc.wait_http_ok(f"{url}/health_generate", timeout_s=900)
    return engines


def _receiver(rank: int, port: int, world_size: int, numel: int, rounds: int, cpu=None) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    buffer = torch.empty(numel, dtype=torch.uint8)
    spent = []
    for _ in range(rounds):
        dist.barrier()
        c0 = time.process_time()
        dist.broadcast(buffer, src=0)
        spent.append(time.process_time() - c0)
    dist.barrier()
    dist.destroy_process_group()
    if cpu is not None:
        cpu.put(spent)


def raw_broadcast_s(numel: int, rounds: int, receivers: int = NUM_ENGINES, busy: bool = False):
    """Best time of one gloo broadcast of `numel` bytes from this process to `receivers` receiving processes; with
    `busy`, (that time, the CPUs the broadcast kept busy then: every process's CPU-seconds in that round over it)."""
    port, world_size = free_port(), 1 + receivers
    ctx = mp.get_context("spawn")
    cpu = ctx.Queue() if busy else None
    receivers = [ctx.Process(target=_receiver, args=(rank, port, world_size, numel, rounds, cpu))
                 for rank in range(1, world_size)]
    for proc in receivers:
        proc.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world_size)
    payload = torch.ones(numel, dtype=torch.uint8)
    best, best_round, spent = float("inf"), 0, []
    for round_ in range(rounds):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        dist.broadcast(payload, src=0)
        elapsed = time.perf_counter() - t0
        spent.append(time.process_time() - c0)
        if elapsed < best:
            best, best_round = elapsed, round_
    dist.barrier()  # the receivers hold the last bytes too
    dist.destroy_process_group()
    theirs = [cpu.get(timeout=60) for _ in receivers] if busy else []
    for proc in receivers:
        proc.join(timeout=60)
    if not busy:
        return best
    return best, (spent[best_round] + sum(each[best_round] for each in theirs)) / best


def sync_rounds(transport: str, urls: list[str], tensors: list, *, bucket_mb: float, rounds: int,
                disk_dir: Path, arch, sharding=None, sharded: bool = False, engine_pids: tuple[int, ...] = ()) -> dict:
    """The fastest of `rounds` whole-model syncs through `transport`, verified as a job verifies them (every engine
    parameter's checksum against the sender's), with its phase breakdown. `sharding`: the engines' (an
    `EngineSharding`; default one rank); `sharded`: each engine rank sent only its own parameters. With
    `engine_pids`, also its CPU-seconds: `cpu_sender_s` (this process, every thread) and `cpu_engines_s` (those
    processes and their descendants: SGLang's tokenizer manager, schedulers, tensor-parallel ranks), and the CPUs
    other jobs kept busy meanwhile (`others_busy`, `OthersBusy`): the load moves from second to second, so each
    sync is estimated with the cores it was left."""
    import functools

    from slimish.weight_sync.checksums import EngineSharding, ExpectedChecksums
    from slimish.weight_sync.sender import sync_to
    from slimish.weight_sync.sharding import EngineLayout

    sharding = sharding or EngineSharding()
    sync = sync_to(urls, transport=transport, group_name=f"bench_{transport}", bucket_bytes=int(bucket_mb * 2**20),
                   disk_dir=str(disk_dir), engine_tp=sharding.tp,
                   expected_checksums=functools.partial(ExpectedChecksums, arch, torch.float32, sharding),
                   layout=EngineLayout(arch, sharding) if sharded else None)
    sync.connect()
    best = None
    try:
        for round_ in range(rounds):
            engines_cpu = sum(_tree_cpu_s(pid) for pid in engine_pids)
            others = OthersBusy()
            others.start()
            t0, c0 = time.perf_counter(), time.process_time()
            metrics = sync.send(iter(tensors), version=f"{transport}-{round_}")
            metrics["sync_s"] = time.perf_counter() - t0
            if engine_pids:
                metrics["cpu_sender_s"] = time.process_time() - c0
                metrics["cpu_engines_s"] = sum(_tree_cpu_s(pid) for pid in engine_pids) - engines_cpu
                metrics["others_busy"] = others.stop()
            if best is None or metrics["sync_s"] < best["sync_s"]:
                best = metrics
    finally:
        sync.close()
    return best


def split_stages(names: list[str], layers: int) -> tuple[list[str], list[str]]:
    """A PP2 trainer's stages: the embedding and the first half of the layers; the rest, the norm and the head."""
    def stage(name: str) -> int:
        if name.startswith("model.layers."):
            return int(int(name.split(".")[2]) >= layers // 2)
        return 0 if name.startswith("model.embed_tokens") else 1
    return [n for n in names if stage(n) == 0], [n for n in names if stage(n) == 1]


def _stage1_process(port: int, model: str, names: list[str], urls: list[str], bucket_mb: float, rounds: int,
                    mode: str) -> None:
    """Pipeline stage 1's leader: with mode 'stages' its own StageSender (as the trainer runs it), with mode
    'funnel' it sends each tensor to rank 0 (as `export_full_hf_tensors` does without stage senders)."""
    import functools

    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.megatron_bridge.hf_io import HFCheckpoint
    from slimish.weight_sync.checksums import ExpectedChecksums
    from slimish.weight_sync.sender import local_context
    from slimish.weight_sync.stages import StageSender

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    ckpt = HFCheckpoint(Path(model))
    tensors = [(name, ckpt.get(name)) for name in names]
    if mode == "stages":
        arch = architecture_from_hf(read_hf_config(Path(model)))
        sender = StageSender(stage=1, context=local_context("bench_pp2_stage1"), engine_urls=urls,
                             bucket_bytes=int(bucket_mb * 2**20), coordinator=0, group=dist.group.WORLD,
                             expected_checksums=functools.partial(ExpectedChecksums, arch, torch.float32))
        dist.barrier()  # rank 0's group first: the engines join one group at a time
        sender.connect()
        dist.barrier()
        for _ in range(rounds):
            sender.send(iter(tensors))
        sender.close()
    else:
        for _ in range(rounds):
            for _, tensor in tensors:
                dist.send(tensor, dst=0)
    dist.barrier()
    dist.destroy_process_group()


def funnel(by_name: dict, stage0: list[str], stage1: list[str]):
    """Rank 0's stream through the funnel: its own stage's tensors, then stage 1's as they arrive from rank 1."""
    yield from ((name, by_name[name]) for name in stage0)
    for name in stage1:
        tensor = torch.empty_like(by_name[name])
        dist.recv(tensor, src=1)
        yield name, tensor


def pp2_rounds(mode: str, urls: list[str], model: Path, tensors: list, layers: int, *, bucket_mb: float,
               rounds: int, arch) -> dict:
    """The fastest of `rounds` syncs from two sender processes standing in for a PP2 trainer's stage leaders:
    `stages` = each stage broadcasts its own buckets (`slimish.weight_sync.stages`), `funnel` = stage 1's tensors
    reach rank 0 first, which sends everything."""
    import functools

    from slimish.weight_sync.checksums import ExpectedChecksums
    from slimish.weight_sync.sender import sync_to
    from slimish.weight_sync.stages import StageLink

    by_name = dict(tensors)
    stage0, stage1 = split_stages([name for name, _ in tensors], layers)
    port = free_port()
    child = mp.get_context("spawn").Process(target=_stage1_process,
                                            args=(port, str(model), stage1, urls, bucket_mb, rounds, mode))
    child.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    sync = sync_to(urls, transport="broadcast", group_name=f"bench_pp2_{mode}", bucket_bytes=int(bucket_mb * 2**20),
                   expected_checksums=functools.partial(ExpectedChecksums, arch, torch.float32))
    sync.connect()
    links = []
    if mode == "stages":
        links = [StageLink(stage=1, rank=1, group=dist.group.WORLD, group_name="bench_pp2_stage1")]
        dist.barrier()
        dist.barrier()  # stage 1 has connected

    best = None
    try:
        for round_ in range(rounds):
            own = funnel(by_name, stage0, stage1) if mode == "funnel" else ((name, by_name[name]) for name in stage0)
            t0 = time.perf_counter()
            metrics = sync.send(own, version=f"pp2-{mode}-{round_}", stages=links)
            metrics["sync_s"] = time.perf_counter() - t0
            if best is None or metrics["sync_s"] < best["sync_s"]:
                best = metrics
    finally:
        sync.close()
        dist.barrier()
        dist.destroy_process_group()
        child.join(timeout=120)
    return best


def _owner_process(port: int, model: str, names: list[str], urls: list[str], bucket_mb: float, rounds: int,
                   mode: str, transport: str, sharding, group_name: str, disk_dir: str) -> None:
    """Pipeline stage 1's sender on the sharded route: with mode 'owned' or 'per_bucket' its own `OwnerSender` (as
    `WeightSender._connect_senders` makes it on the "stages" route: it cuts its stage into the engine ranks' parts,
    stages and hashes them itself), with mode 'funnel' it sends each tensor to rank 0 instead. A barrier before each
    sync starts both senders together."""
    import functools

    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.megatron_bridge.hf_io import HFCheckpoint
    from slimish.weight_sync.checksums import ExpectedChecksums
    from slimish.weight_sync.owners import OwnerSender
    from slimish.weight_sync.sender import local_context
    from slimish.weight_sync.sharding import EngineLayout

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    ckpt = HFCheckpoint(Path(model))
    tensors = [(name, ckpt.get(name)) for name in names]
    sender = None
    if mode != "funnel":
        arch = architecture_from_hf(read_hf_config(Path(model)))
        sender = OwnerSender(rank=1, transport=transport, layout=EngineLayout(arch, sharding), engines=len(urls),
                             bucket_bytes=int(bucket_mb * 2**20), coordinator=0, group=dist.group.WORLD,
                             disk_dir=disk_dir,
                             expected_checksums=functools.partial(ExpectedChecksums, arch, torch.float32, sharding),
                             context=local_context(group_name, engine_tp=sharding.tp, disk_dir=disk_dir))
    for _ in range(rounds):
        dist.barrier()
        if sender is not None:
            sender.send(iter(tensors))
        else:
            for _, tensor in tensors:
                dist.send(tensor, dst=0)
    if sender is not None:
        sender.close()
    dist.barrier()
    dist.destroy_process_group()


def one_request_per_bucket(transport) -> None:
    """Bench knob (emulation, no production switch): make a `BroadcastTransport` post each sender's bucket in a
    request of its own, rank 0's first, instead of one request per round naming every sender's next bucket
    (`push_round`): the round's buckets then cross the wire one after the other."""
    from slimish.weight_sync.broadcast import BroadcastTransport

    def push_round(own, owned):
        nbytes = transport.push_shards(own, version=None) if own is not None else 0
        for bucket in owned:
            BroadcastTransport.push_round(transport, None, [bucket])
        return nbytes

    transport.push_round = push_round


def two_sender_rounds(mode: str, transport: str, urls: list[str], model: Path, tensors: list, layers: int, *,
                      bucket_mb: float, rounds: int, arch, sharding, disk_dir: Path) -> dict:
    """The fastest of `rounds` sharded syncs (each engine rank only its own parameters) from two sender processes
    standing in for a PP2 trainer's stage leaders: `owned` = stage 1 stages and sends its own parts (`OwnerSender`,
    rank 0 posting the requests: over broadcast one per round), `per_bucket` = the same posted one request per
    bucket (`one_request_per_bucket`; broadcast only), `funnel` = stage 1's tensors reach rank 0 first, which sends
    everything. `cpu_s`: the CPU-seconds of the sync's every process (both senders and the engine's tree)."""
    import functools

    from slimish.weight_sync.checksums import ExpectedChecksums
    from slimish.weight_sync.owners import OwnerLink
    from slimish.weight_sync.sender import sync_to
    from slimish.weight_sync.sharding import EngineLayout

    by_name = dict(tensors)
    stage0, stage1 = split_stages([name for name, _ in tensors], layers)
    port, group_name = free_port(), f"bench_two_{transport}_{mode}"
    disk_dir.mkdir(parents=True, exist_ok=True)
    child = mp.get_context("spawn").Process(
        target=_owner_process,
        args=(port, str(model), stage1, urls, bucket_mb, rounds, mode, transport, sharding, group_name, str(disk_dir)))
    child.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    sync = sync_to(urls, transport=transport, group_name=group_name, bucket_bytes=int(bucket_mb * 2**20),
                   disk_dir=str(disk_dir), engine_tp=sharding.tp, layout=EngineLayout(arch, sharding),
                   expected_checksums=functools.partial(ExpectedChecksums, arch, torch.float32, sharding))
    if mode == "per_bucket":
        one_request_per_bucket(sync.transport)
    sync.connect()

    best = None
    try:
        for round_ in range(rounds):
            links = [] if mode == "funnel" else [OwnerLink(stage=1, rank=1, group=dist.group.WORLD)]
            own = funnel(by_name, stage0, stage1) if mode == "funnel" else ((name, by_name[name]) for name in stage0)
            dist.barrier()
            cpu = _tree_cpu_s(os.getpid())  # this process, stage 1's and the engine's (all its descendants)
            t0 = time.perf_counter()
            metrics = sync.send(own, version=f"two-{transport}-{mode}-{round_}", stages=links)
            metrics["sync_s"] = time.perf_counter() - t0
            metrics["cpu_s"] = _tree_cpu_s(os.getpid()) - cpu
            if best is None or metrics["sync_s"] < best["sync_s"]:
                best = metrics
    finally:
        sync.close()
        dist.barrier()
        dist.destroy_process_group()
        # No timeout: its sentinel pipe outlives it in the torch_shm_manager it started (tensor), and join(timeout)
        # waits on that pipe; the child has passed the last barrier and exits.
        child.join()
    return best


def wire_model_ratio(transport: str, stage_bytes: list[float], *, tp: int, replicated: float) -> float:
    """What `slimish.weight_sync.estimate.sync_seconds` predicts for funnel s / two senders s on a cluster (one NIC
    per sender): the sharded sync from rank 0 with stage 1 funnelled to it, against the "stages" route from both
    stages' leaders with these bytes. Not this machine's model (`cpu_sync_seconds` has no several senders)."""
    from slimish.weight_sync.estimate import StageBytes, sync_seconds

    model = sum(stage_bytes)
    one = sync_seconds(model, transport=transport, pipeline_parallel=2, stage_senders=False, engine_shards=tp,
                       replicated_bytes=replicated)
    two = sync_seconds(model, transport=transport, engine_shards=tp, replicated_bytes=replicated, route="stages",
                       stages=[StageBytes(dense=b) for b in stage_bytes])
    return one / two


def senders_main(args) -> None:
    """One engine of `args.engine_tp` ranks; the sharded sync from two senders against the funnel through rank 0
    (and, over broadcast, against one request per bucket) per transport (see the module docstring)."""
    from slimish.weight_sync.checksums import sharding_of

    tp, size = args.engine_tp, args.bucket_mb[0]
    root = Path(tempfile.mkdtemp(prefix="bench-sync-senders-", dir=args.workdir))
    engines = []
    try:
        model, arch, tensors, nbytes = load_model(root, args.layers)
        t0 = time.monotonic()
        engines = start_engines(model, root, count=1, tp=tp)
        urls = [url for _, url in engines]
        sharding = sharding_of(urls[0], api_key=None)
        print(f"1 engine of {tp} tensor-parallel ranks up in {time.monotonic() - t0:.0f}s; "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
        stage0, _ = split_stages([name for name, _ in tensors], args.layers)
        stage_bytes = [float(sum(t.numel() * t.element_size() for n, t in tensors if (n in stage0) == first))
                       for first in (True, False)]
        replicated = float(sum(t.numel() * t.element_size() for n, t in tensors if "norm" in n))
        results = {}
        cases = [(t, m) for t in ("disk", "tensor", "broadcast")
                 for m in ("funnel", "owned", *(("per_bucket",) if t == "broadcast" else ()))]
        for transport, mode in cases:  # broadcast last: its line is the figure
            best = two_sender_rounds(mode, transport, urls, model, tensors, args.layers, bucket_mb=size,
                                     rounds=args.rounds, arch=arch, sharding=sharding, disk_dir=root / "disk")
            results[transport, mode] = best
            sent = {k.removeprefix("sync_sent_").removesuffix("_mib"): round(v) for k, v in sorted(best.items())
                    if k.startswith("sync_sent_rank")}
            ranks = [round(best[f"sync_engine_rank{r}_mib"]) for r in range(tp)]
            print(f"two-senders {transport} {mode} bucket_mb={size:g}: {best['sync_s']:.2f}s cpu_s={best['cpu_s']:.2f} "
                  f"requests={best['sync_requests']} buckets={best['sync_buckets']} senders={best['sync_senders']} "
                  f"MiB sent {sent} MiB per engine rank {ranks} load_average_1min={os.getloadavg()[0]:.1f} | "
                  f"{phase_line(best)}", flush=True)
        for transport in ("disk", "tensor", "broadcast"):
            funnel, owned = results[transport, "funnel"], results[transport, "owned"]
            model_ratio = "" if transport == "tensor" else \
                f" wire_model_ratio={wire_model_ratio(transport, stage_bytes, tp=tp, replicated=replicated):.2f}"
            rounds_part = ""
            if (transport, "per_bucket") in results:
                per_bucket = results[transport, "per_bucket"]
                rounds_part = (f" rounds_vs_per_bucket_ratio={per_bucket['sync_s'] / owned['sync_s']:.2f} "
                               f"per_bucket_s={per_bucket['sync_s']:.2f} "
                               f"requests_rounds={owned['sync_requests']} "
                               f"requests_per_bucket={per_bucket['sync_requests']}")
            print(f"transport={transport} two_senders_vs_funnel_ratio={funnel['sync_s'] / owned['sync_s']:.2f} "
                  f"funnel_s={funnel['sync_s']:.2f} two_senders_s={owned['sync_s']:.2f}{rounds_part} "
                  f"buckets={owned['sync_buckets']} rank0_mib={owned['sync_sent_rank0_mib']:.0f} "
                  f"rank1_mib={owned['sync_sent_rank1_mib']:.0f}{model_ratio} "
                  f"load_average_1min={os.getloadavg()[0]:.1f} engine_tp={tp} bucket_mb={size:g}", flush=True)
    finally:
        for proc, _ in engines:
            proc.stop()
        shutil.rmtree(root, ignore_errors=True)


def best_s(fn, rounds: int, *, clock=time.perf_counter, after=None) -> float:
    """The least `clock` time `fn` took in `rounds` calls; `after(result)`, if given, runs after each, untimed."""
    best = float("inf")
    for _ in range(rounds):
        t0 = clock()
        result = fn()
        best = min(best, clock() - t0)
        if after is not None:
            after(result)
    return best


def cpu_best_s(fn, rounds: int) -> float:
    """The fewest CPU-seconds of this process (user and system, all its threads: torch may split a copy) `fn` took in
    `rounds` calls: its cost, whatever else the machine runs meanwhile (`OthersBusy` measures that)."""
    return best_s(fn, rounds, clock=time.process_time)


def _tree_cpu_s(root: int) -> float:
    """CPU-seconds of process `root` and its descendants so far (their own and their reaped children's), from
    /proc."""
    tick, parents, cpu = os.sysconf("SC_CLK_TCK"), {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = sum(int(v) for v in fields[11:15]) / tick
    mine = {root}
    for pid in sorted(parents):  # walk up from each process: a descendant of root counts
        chain, up = [], pid
        while up in parents and up not in mine and up > 1:
            chain.append(up)
            up = parents[up]
        if up in mine:
            mine.update(chain)
    return sum(cpu.get(pid, 0.0) for pid in mine)


class OthersBusy:
    """The CPUs other jobs kept busy between `start` and `stop` (/proc/stat's busy time less this process tree's),
    in cores: what the machine did not leave the syncs."""

    def start(self) -> None:
        self._t, self._busy, self._own = time.monotonic(), self._machine_busy_s(), _tree_cpu_s(os.getpid())

    def stop(self) -> float:
        elapsed = time.monotonic() - self._t
        busy = self._machine_busy_s() - self._busy
        own = _tree_cpu_s(os.getpid()) - self._own
        return max(0.0, (busy - own) / elapsed)

    @staticmethod
    def _machine_busy_s() -> float:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle, iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def request_costs(url: str, smallest: tuple, *, engine_tp: int, rounds: int = 10) -> tuple[float, float]:
    """(seconds, CPU-seconds of this process and the engine's) of one engine request of a sync that moves next to no
    bytes, the mean of `rounds` syncs of the model's `smallest` (name, tensor) with its own value through the tensor
    transport, unverified: /begin_weight_update, its one bucket, /end_weight_update. What every request of a sync
    costs besides its bytes: pickling, HTTP, SGLang's tokenizer manager, scheduler and tensor-parallel workers."""
    from slimish.weight_sync.sender import sync_to

    sync = sync_to([url], transport="tensor", group_name="bench_requests", bucket_bytes=2**20, engine_tp=engine_tp,
                   verify=False)
    sync.connect()
    try:
        sync.send(iter([smallest]), version="requests-warm")
        c0, t0 = _tree_cpu_s(os.getpid()), time.perf_counter()
        for round_ in range(rounds):
            sync.send(iter([smallest]), version=f"requests-{round_}")
        seconds, cpu = time.perf_counter() - t0, _tree_cpu_s(os.getpid()) - c0
    finally:
        sync.close()
    return seconds / rounds / 3, cpu / rounds / 3


def measure_machine(nbytes: int, *, receivers: int, rounds: int, directory: Path, url: str | None = None,
                    others_busy: float = 0.0, smallest: tuple | None = None, bucket_bytes: int = 64 << 20):
    """This node's rates for `slimish.weight_sync.estimate.Machine`, each the best of `rounds` on `nbytes`. As
    CPU-seconds (`cpu_best_s`: the cost, whatever else runs meanwhile): a copy into a reused buffer, into a fresh one
    (its pages faulted in, as an engine's receive buffer per bucket), and out of a fresh mapping of a shared-memory
    segment (/dev/shm, as the tensor transport's engines map its buckets); SGLang's CPU checksum; copying a file in
    `directory` (the disk transport's, so the page cache is as warm as the transport finds it) out of a fresh mapping
    (as safetensors loads it); writing it as the transport does (fresh files of `bucket_bytes`, all kept until the
    last is written, then removed). As seconds: that write (it waits on I/O too), a
    raw gloo broadcast to `receivers` processes (bytes put out per second, and the CPUs it keeps busy); with `url`
    and `smallest` (the model's smallest (name, tensor)) an engine request's seconds and CPU-seconds
    (`request_costs`, the mean of 10).
    `cores`: the CPUs this process may run on less `others_busy` (`OthersBusy`)."""
    from slimish.weight_sync.checksums import tensor_checksum
    from slimish.weight_sync.estimate import GB, Machine

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = cpu_best_s(lambda: dst.copy_(src), rounds)
    fresh_s = cpu_best_s(lambda: torch.empty_like(src).copy_(src), rounds)
    hash_s = cpu_best_s(lambda: tensor_checksum(src), rounds)
    link_s, link_busy = raw_broadcast_s(nbytes, rounds, receivers=receivers, busy=True)
    directory.mkdir(parents=True, exist_ok=True)
    view = memoryview(src.numpy()).cast("B")

    def write(path: Path):
        with open(path, "wb") as f:
            f.write(view)

    def mapped_copy(path: Path):  # a fresh mapping each time: its pages are faulted in as the copy reads them
        dst.copy_(torch.from_file(str(path), shared=True, size=src.numel(), dtype=src.dtype))

    def write_buckets():  # as the disk transport: a fresh file per bucket, every one kept until the sync is loaded
        pieces = range(0, nbytes, bucket_bytes)
        for start in pieces:
            with open(directory / f"bucket-{start // bucket_bytes:05d}.bin", "wb") as f:
                f.write(view[start:start + bucket_bytes])
        return [directory / f"bucket-{start // bucket_bytes:05d}.bin" for start in pieces]

    def remove(paths):
        for each in paths:
            each.unlink()

    # Seconds, not CPU-seconds: writing waits on I/O too; the removal comes after the load, untimed.
    write_s = best_s(write_buckets, rounds, after=remove)
    # Its CPU-seconds, with the removal: the transport writes fresh files every sync and removes them after it.
    write_cpu_s = cpu_best_s(lambda: remove(write_buckets()), rounds)
    path = directory / "machine.bin"
    write(path)
    read_s = cpu_best_s(lambda: mapped_copy(path), rounds)
    path.unlink()
    segment = Path("/dev/shm") / f"slimish-bench-{os.getpid()}.bin"
    try:
        write(segment)
        mapped_s = cpu_best_s(lambda: mapped_copy(segment), rounds)
    finally:
        segment.unlink(missing_ok=True)
    request_s = request_cpu_s = 0.0
    if url is not None and smallest is not None:
        try:
            request_s, request_cpu_s = request_costs(url, smallest, engine_tp=receivers)
        except Exception as err:  # noqa: BLE001 - the other rates still calibrate; say so
            print(f"engine request costs not measured ({err}); counted as 0", flush=True)
    return Machine(request_s=request_s, request_cpu_s=request_cpu_s, copy_gbyte_s=nbytes / copy_s / GB,
                   hash_gbyte_s=nbytes / hash_s / GB,
                   link_gbyte_s=nbytes * receivers / link_s / GB, fs_write_gbyte_s=nbytes / write_s / GB,
                   fs_write_cpu_gbyte_s=nbytes / write_cpu_s / GB, fs_read_gbyte_s=nbytes / read_s / GB,
                   mapped_gbyte_s=nbytes / mapped_s / GB,
                   fresh_gbyte_s=nbytes / fresh_s / GB, link_busy_cores=link_busy,
                   cores=max(0.1, len(os.sched_getaffinity(0)) - others_busy))


FUSED_PARTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # SGLang fuses them: qkv_proj, gate_up_proj


def calibrate(results: dict, tensors: list, *, tp: int, machine, layout) -> None:
    """The estimate (`slimish.weight_sync.estimate.cpu_sync_seconds`, fed `machine`) against each measured sync,
    and its bytes per engine rank against the sender's counters; the last line is the worst error. `layout`: the
    engine's (`EngineLayout`), whose per-rank slices tell which the sender hashes from strided views."""
    from slimish.weight_sync.estimate import cpu_sync_seconds, cpu_sync_terms, cpu_sync_work, payload

    def nbytes(keep) -> float:
        return float(sum(t.numel() * t.element_size() for name, t in tensors if keep(name)))

    model, replicated = nbytes(lambda name: True), nbytes(lambda name: "norm" in name)
    fused = nbytes(lambda name: any(part in name for part in FUSED_PARTS))
    strided = float(sum(piece.numel() * piece.element_size() for name, tensor in tensors
                        for *_, piece in layout.pieces(name, tensor) if not piece.is_contiguous()))
    print(f"machine (best of rounds, shared machine): {machine}", flush=True)
    errors = {}
    for (transport, route), best in results.items():
        load = payload(model, engine_tp=tp, sharded=route == "sharded", replicated_bytes=replicated,
                       fused_bytes=fused, strided_bytes=strided)
        # The cores this sync was left (other jobs' load moves between syncs), else those of the whole run.
        left = len(os.sched_getaffinity(0)) - best["others_busy"] if "others_busy" in best else machine.cores
        case = dataclasses.replace(machine, cores=max(0.1, left))
        estimated = cpu_sync_seconds(load, transport=transport, machine=case, buckets=best["sync_buckets"])
        terms = cpu_sync_terms(load, transport=transport, machine=case, buckets=best["sync_buckets"])
        measured_mib = max(best[f"sync_engine_rank{r}_mib"] for r in range(tp))
        cpu_estimated = sum(cpu_sync_work(load, transport=transport, machine=case, buckets=best["sync_buckets"]))
        cpu_measured = best.get("cpu_sender_s", 0.0) + best.get("cpu_engines_s", 0.0)
        errors[transport, route] = estimated / best["sync_s"] - 1
        print(f"calibration transport={transport} route={route} measured_s={best['sync_s']:.2f} "
              f"estimated_s={estimated:.2f} estimated_vs_measured={estimated / best['sync_s']:.2f} "
              f"rank_mib_measured={measured_mib:.1f} rank_mib_estimated={load.rank_bytes / 2**20:.1f} "
              f"cpu_s_measured={cpu_measured:.2f} cpu_s_estimated={cpu_estimated:.2f} cores={case.cores:.2f} | "
              + " ".join(f"{k}={v:.2f}s" for k, v in terms.items()), flush=True)
    worst = max(errors, key=lambda case: abs(errors[case]))
    full, sharded = results["tensor", "full"], results["tensor", "sharded"]
    print(f"calibration_worst_abs_error={abs(errors[worst]):.2f} worst_case={worst[0]}-{worst[1]} "
          f"within_30pct={sum(abs(e) <= 0.3 for e in errors.values())}/{len(errors)} "
          f"sharded_vs_full_ratio={full['sync_s'] / sharded['sync_s']:.2f} (tensor) engine_tp={tp} "
          f"load_average_1min={os.getloadavg()[0]:.1f} cores={machine.cores:.2f} (all syncs)", flush=True)


def phase_line(metrics: dict) -> str:
    """A sync's phases, e.g. 'flatten=1.45s wire=1.48s'."""
    return " ".join(f"{key.removeprefix('time_').removesuffix('_s')}={value:.2f}s"
                    for key, value in sorted(metrics.items()) if key.startswith("time_"))


def sharded_main(args) -> None:
    """One engine of `args.engine_tp` ranks; full vs sharded per transport (see the module docstring)."""
    from slimish.weight_sync.checksums import sharding_of
    from slimish.weight_sync.sharding import EngineLayout

    tp, size = args.engine_tp, args.bucket_mb[0]
    root = Path(tempfile.mkdtemp(prefix="bench-sync-sharded-", dir=args.workdir))
    engines = []
    try:
        model, arch, tensors, nbytes = load_model(root, args.layers)
        t0 = time.monotonic()
        engines = start_engines(model, root, count=1, tp=tp)
        urls = [url for _, url in engines]
        sharding = sharding_of(urls[0], api_key=None)
        print(f"1 engine of {tp} tensor-parallel ranks up in {time.monotonic() - t0:.0f}s", flush=True)
        results, others = {}, OthersBusy()
        others.start()
        for transport in ("disk", "broadcast", "tensor"):  # tensor last: its ratio is the figure
            for route in ("full", "sharded"):
                best = sync_rounds(transport, urls, tensors, bucket_mb=size, rounds=args.rounds,
                                   disk_dir=root / "disk", arch=arch, sharding=sharding, sharded=route == "sharded",
                                   engine_pids=tuple(proc.pid for proc, _ in engines))
                results[transport, route] = best
                ranks = [best[f"sync_engine_rank{r}_mib"] for r in range(tp)]
                print(f"{transport} {route} bucket_mb={size:g}: {best['sync_s']:.2f}s, MiB per engine rank "
                      f"{[round(m) for m in ranks]} | {phase_line(best)} | CPU-seconds: sender "
                      f"{best['cpu_sender_s']:.2f} engine {best['cpu_engines_s']:.2f}", flush=True)
        others_busy = others.stop()
        print(f"other jobs kept {others_busy:.2f} of {len(os.sched_getaffinity(0))} CPUs busy during the syncs "
              f"(load average {os.getloadavg()[0]:.1f})", flush=True)
        for transport in ("disk", "broadcast", "tensor"):
            full, sharded = results[transport, "full"], results[transport, "sharded"]
            print(f"transport={transport} sharded_vs_full_ratio={full['sync_s'] / sharded['sync_s']:.2f} "
                  f"full_s={full['sync_s']:.2f} sharded_s={sharded['sync_s']:.2f} "
                  f"rank_mib_full={full['sync_engine_rank0_mib']:.0f} "
                  f"rank_mib_sharded={max(sharded[f'sync_engine_rank{r}_mib'] for r in range(tp)):.0f} "
                  f"model_mib={nbytes / 2**20:.0f} engine_tp={tp} bucket_mb={size:g}", flush=True)
        machine = measure_machine(nbytes, receivers=tp, rounds=args.rounds, directory=root / "disk", url=urls[0],
                                  others_busy=others_busy, smallest=min(tensors, key=lambda item: item[1].numel()),
                                  bucket_bytes=int(size * 2**20))
        calibrate(results, tensors, tp=tp, machine=machine, layout=EngineLayout(arch, sharding))
    finally:
        for proc, _ in engines:
            proc.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=22, help="decoder layers (22: 1.1 GiB in fp32)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[64.0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--engine-tp", type=int, default=1,
                        help="> 1: one engine of this many ranks, full vs sharded sync per transport")
    parser.add_argument("--senders", type=int, choices=(1, 2), default=1,
                        help="2 (with --engine-tp > 1): only the sharded sync from two senders against the funnel")
    args = parser.parse_args()
    if args.engine_tp > 1 and args.senders == 2:
        senders_main(args)
        return
    if args.engine_tp > 1:
        sharded_main(args)
        return

    root = Path(tempfile.mkdtemp(prefix="bench-sync-", dir=args.workdir))
    engines = []
    try:
        model, arch, tensors, nbytes = load_model(root, args.layers)
        t0 = time.monotonic()
        engines = start_engines(model, root)
        print(f"{NUM_ENGINES} engines up in {time.monotonic() - t0:.0f}s", flush=True)
        raw_s = raw_broadcast_s(nbytes, args.rounds)
        print(f"raw gloo broadcast of {nbytes / 2**20:.0f} MiB to {NUM_ENGINES} processes: {raw_s:.2f}s "
              f"({nbytes / 2**30 / raw_s:.2f} GiB/s)", flush=True)
        runs = [(transport, size) for transport in TRANSPORTS for size in reversed(args.bucket_mb)]
        results = {}
        for transport, size in runs:
            best = sync_rounds(transport, [url for _, url in engines], tensors, bucket_mb=size,
                               rounds=args.rounds, disk_dir=root / "disk", arch=arch)
            results[transport, size] = best
            print(f"{transport} bucket_mb={size:g}: {best['sync_s']:.2f}s | {phase_line(best)}", flush=True)
        pp2 = {}
        for mode in ("funnel", "stages"):
            pp2[mode] = pp2_rounds(mode, [url for _, url in engines], model, tensors, args.layers,
                                   bucket_mb=args.bucket_mb[0], rounds=args.rounds, arch=arch)
            print(f"pp2 {mode} bucket_mb={args.bucket_mb[0]:g}: {pp2[mode]['sync_s']:.2f}s "
                  f"senders={pp2[mode]['sync_senders']} | {phase_line(pp2[mode])}", flush=True)
        stage1_busy = sum(v for k, v in pp2["stages"].items() if k.endswith("_stage1_s") and "wire" not in k)
        print(f"pp2 stage_senders_vs_funnel={pp2['funnel']['sync_s'] / pp2['stages']['sync_s']:.2f} "
              f"funnel_s={pp2['funnel']['sync_s']:.2f} stages_s={pp2['stages']['sync_s']:.2f} "
              f"stage1_flatten_and_hash_s={stage1_busy:.2f} (done on stage 1 while rank 0 worked)", flush=True)
        for transport, size in runs:
            best = results[transport, size]
            print(f"transport={transport} sync_vs_raw_ratio={raw_s / best['sync_s']:.2f} "
                  f"model_mib={nbytes / 2**20:.0f} buckets={best['sync_buckets']} sync_s={best['sync_s']:.2f} "
                  f"raw_s={raw_s:.2f} bucket_mb={size:g}", flush=True)
    finally:
        for proc, _ in engines:
            proc.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
