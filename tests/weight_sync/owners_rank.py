"""One rank of tests/weight_sync/test_owners.py: an expert-parallel trainer (Megatron on gloo) syncs a tiny MoE to a
stand-in engine of two tensor-parallel ranks (TP2 EP2 or EP1, CPU, slimish's loaders listed), once through rank 0 (the
funnel: `WeightSender` with the owners' route turned off) and once from the experts' owners, with each transport
given. The stand-in, on rank 0, does with each request what an engine rank does with its own entry: unpickles it
(mapping the sender's shared segment by name, the owners' included) or reads its files, and keeps each (engine
parameter or expert slot) tensor; it reports, per rank, SGLang's checksum of every parameter it holds, the experts'
stacked from their slots, which the sync verifies against the trainer's prediction. With --engine-device cuda it says
it runs on CUDA and reports the tile hash (`slimish.weight_sync.tile_hash`), as a CUDA engine does.

  python tests/weight_sync/owners_rank.py --rank R --world-size W --port P --tp T [--etp E] [--ep 2] [--pp 1] \
      [--engine-ep 1] [--engine-device cuda] [--no-verify] --model HF_DIR --out OUT --transport tensor|disk \
      [--faults first owner tp corrupt]
Rank 0 writes OUT/result.pt: {route: {"held": per engine rank {name: tensor}, "metrics": the sync's, "failed": what
the failed sync raised}}. With --faults, each fault is one more route from the owners: with "first" / "owner" the
engine fails that request, the sync fails on rank 0 (and the owners give up), and a sync on a new connection then
delivers the model; with "tp" the engine reports another TP size: {"failed": what connect raised on rank 0}, and rank
1 writes OUT/tp_rank1.pt, {"failed": what its connect returned}; with "corrupt" the engine's rank 1 holds its
last expert slot of layer 0's w13_weight plus one when it reports its checksums (once): the sync fails verifying.
With "frozen" / "killed" (broadcast), engine rank 1 freezes (SIGSTOP) or dies once it has joined the owner's group
for the owner's first bucket, the stand-in's watchdog releases the sync (`WeightSender.release`), and the next sync
goes to a fresh stand-in (the restarted engine; a spare rank process for the killed one).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import multiprocessing
import os
import pickle
import signal
import threading
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from slimish.config.engine_flags import SHARD_DIRECT, SHARD_LOADER, SHARD_RECEIVER


class RankParams:
    """What `receive_shard` loads into, in an engine rank process of the stand-in: a parameter (or a stacked
    expert parameter, as many slots as the entries name) of each name and shape the round's entries `specs` name."""

    def __init__(self, specs: list[dict]):
        from slimish.weight_sync.engine_loader import parse_slot

        shapes: dict[str, tuple] = {}
        names, dtypes, shapes_of = ([item for spec in specs for item in spec[key]]
                                    for key in ("names", "dtypes", "shapes"))
        for name, dtype, shape in zip(names, dtypes, shapes_of):
            param, slot = parse_slot(name)
            if slot is None:
                shapes[param] = (tuple(shape), dtype)
            else:
                slots = max(slot + 1, shapes.get(param, ((0,), dtype))[0][0])
                shapes[param] = ((slots, *shape), dtype)
        self.names = names
        self.params = {name: torch.nn.Parameter(torch.full(shape, float("nan"), dtype=getattr(torch, dtype),
                                                           device="cpu"), requires_grad=False)
                       for name, (shape, dtype) in shapes.items()}
        # An engine rank always has parameters (receive_shard reads their device), though a part may name none.
        self.params["stand_in.placeholder"] = torch.nn.Parameter(torch.zeros(1, device="cpu"), requires_grad=False)

    def named_parameters(self):
        return iter(self.params.items())

    def parameters(self):
        return iter(self.params.values())

    def loaded(self) -> dict[str, torch.Tensor]:
        from slimish.weight_sync.engine_loader import parse_slot

        out = {}
        for name in self.names:
            param, slot = parse_slot(name)
            out[name] = (self.params[param].data if slot is None else self.params[param].data[slot]).clone()
        return out


def serve_rank(conn) -> None:
    """One engine rank of the stand-in (a process of its own, forked before any group exists: a process cannot hold
    two groups of one name, and the sender's side of each group is in rank 0's process): runs slimish's engine-side
    `receive_shard` on each entry it is sent, which joins the sender's group and receives its part, and sends back
    what it loaded (torch.save bytes) or the error; ("reset",) drops its groups (a new engine). An entry sent with a
    fault ("load", entry, "freeze" / "die") makes the rank, once it has joined the group, report ("frozen" / "dying",
    its pid) and stop itself (SIGSTOP: frozen inside the broadcast until the stand-in continues it) or exit."""
    from slimish.weight_sync import engine_loader

    join = engine_loader._join

    def faulty_join(fault: str):
        def joined(spec):
            group = join(spec)
            if "_owner" not in spec["group"]:  # a round may name rank 0's group first: the fault is the owner's
                return group
            conn.send(("frozen" if fault == "freeze" else "dying", os.getpid()))
            if fault == "die":
                os._exit(1)
            os.kill(os.getpid(), signal.SIGSTOP)
            return group
        return joined

    while (message := conn.recv()) is not None:
        try:
            if message[0] == "reset":
                for _, group in engine_loader._GROUPS.values():
                    dist.destroy_process_group(group)
                engine_loader._GROUPS.clear()
                conn.send(("ok", b""))
                continue
            engine_loader._join = faulty_join(message[2]) if len(message) > 2 else join
            named = pickle.loads(base64.b64decode(message[1]))
            model = RankParams([json.loads(spec) for spec, _ in named])
            engine_loader.receive_shard(model, named)
            buffer = io.BytesIO()
            torch.save(model.loaded(), buffer)
            conn.send(("ok", buffer.getvalue()))
        except Exception as exc:  # noqa: BLE001 - reported to the stand-in engine, which fails the request
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def start_ranks(tp: int) -> list:
    """The stand-in's engine rank processes (broadcast), forked now, before this process has any group or thread."""
    import sglang.srt.model_loader.weight_utils  # noqa: F401 - what receive_shard imports, once, before forking
    import sglang.srt.utils  # noqa: F401

    fork = multiprocessing.get_context("fork")
    conns = []
    for _ in range(tp):
        parent, child = fork.Pipe()
        fork.Process(target=serve_rank, args=(child,), daemon=True).start()
        conns.append(parent)
    return conns


class _Peek(pickle.Unpickler):
    """Reads a `receive_shard` entry without rebuilding its marker tensor: each unpickling of a tensor shared by name
    drops a reference to its segment, and the engine rank's own must find it."""

    def find_class(self, module, name):
        if module.startswith("torch.multiprocessing"):
            return lambda *args: None
        return super().find_class(module, name)


class Engine:
    """A stand-in engine of `tp` ranks at `url`: see the module docstring. `ranks`: its rank processes
    (`start_ranks`), which receive the broadcast transport's shards."""

    def __init__(self, url: str, tp: int, ep: int, fail: str = "", ranks: list | None = None, device: str = "cpu"):
        self.url, self.tp, self.ep, self.fail, self.ranks, self.device = url, tp, ep, fail, ranks or [], device
        # "frozen" / "killed": the watchdog's release (`WeightSender.release`), set by the test; `thaw` ends a freeze
        self.watchdog, self.thawed, self.settled = None, threading.Event(), threading.Event()
        self.settled.set()
        self.held: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        self.version = "default"
        for conn in self.ranks:  # a fresh engine: no group of an earlier one
            conn.send(("reset",))
            assert conn.recv()[0] == "ok"

    def server_info(self) -> dict:
        return {"tp_size": self.tp * (2 if self.fail == "tp" else 1), "ep_size": self.ep, "device": self.device,
                "custom_weight_loader": [SHARD_LOADER, SHARD_DIRECT, SHARD_RECEIVER]}

    def begin_weight_update(self):
        return {}

    end_weight_update = begin_weight_update

    def _receive(self, serialized, weight_version) -> dict:
        """Broadcast: each rank process receives its own entry (`serve_rank`). A fault fails engine rank 1 before it
        joins its group (as an engine rank that died would); rank 0 takes its part, or fails once the sender gives up
        on the group it cannot complete."""
        # Per engine rank, the round's entries (one per sender): the faults are the owners' buckets' for rank 1.
        specs = [[json.loads(spec) for spec, _ in _Peek(io.BytesIO(base64.b64decode(payload))).load()]
                 for payload in serialized]
        owners = any("_owner" in spec["group"] and any(name.endswith("]") for name in spec["names"])
                     for spec in specs[1])
        failing = self.fail == "first" or (self.fail == "owner" and owners)
        mid_broadcast = self.fail in ("frozen", "killed") and owners
        if failing or mid_broadcast:
            fault, self.fail = self.fail, ""
        asked = [rank for rank in range(self.tp) if not (failing and rank == 1)]
        for rank in asked:
            self.ranks[rank].send(("load", serialized[rank], *([{"frozen": "freeze", "killed": "die"}[fault]]
                                                                if mid_broadcast and rank == 1 else [])))
        if mid_broadcast:
            return self._fail_mid_broadcast(fault)
        answers = {rank: self.ranks[rank].recv() for rank in asked}
        if failing:
            raise RuntimeError("engine stand-in: this bucket fails")
        for rank, (status, data) in answers.items():
            if status != "ok":
                raise RuntimeError(f"engine stand-in rank {rank}: {data}")
            self.held[rank].update(torch.load(io.BytesIO(data)))
        if weight_version is not None:
            self.version = weight_version
        return {}

    def _fail_mid_broadcast(self, fault: str) -> dict:
        """Rank 1 has been sent an owner's bucket with a fault: once it has joined the owner's group it is frozen
        (stopped) or killed; the watchdog then releases the sync (as the job's does on seeing the engine freeze or
        die). Killed, the request fails at once (the engine's connection drops); frozen, it answers nothing until
        `thaw` (the sync has failed meanwhile). Rank 0 of the engine takes its part meanwhile."""
        self.settled.clear()
        status, pid = self.ranks[1].recv()
        if fault == "killed":
            os.waitpid(pid, 0)  # gone before the watchdog sees it
        self.watchdog(f"engine {self.url} {'froze' if fault == 'frozen' else 'died'} (stand-in)")
        if fault == "frozen":
            self.thawed.wait()
            os.kill(pid, signal.SIGCONT)
            self.ranks[1].recv()  # its receive's end: delivered (the bytes were buffered) or failed; either way done
        self.ranks[0].recv()
        self.settled.set()
        raise RuntimeError(f"engine {self.url}: its rank 1 {'froze' if fault == 'frozen' else 'was killed'}")

    def thaw(self) -> None:
        """End a freeze (the sync has failed) and wait until the request it held has ended."""
        self.thawed.set()
        self.settled.wait()

    def update_weights_from_tensor(self, *, serialized, load_format, weight_version, flush_cache):
        if load_format == SHARD_RECEIVER:
            return self._receive(serialized, weight_version)
        loaded = [pickle.loads(base64.b64decode(payload)) for payload in serialized]
        # "first": the first request fails (one of rank 0's own buckets); "owner": the first with expert slots for
        # engine rank 1 (EP rank 1's, from its owner).
        if self.fail == "first" or (self.fail == "owner" and any(name.endswith("]") for name, _ in loaded[1])):
            self.fail = ""
            raise RuntimeError("engine stand-in: this bucket fails")
        for rank, pairs in enumerate(loaded):
            if load_format == SHARD_LOADER:
                from safetensors.torch import load_file

                pairs = [item for path, _ in pairs for item in load_file(path).items()]
            for name, tensor in pairs:
                self.held[rank][name] = tensor.clone()
        if weight_version is not None:
            self.version = weight_version
        return {}

    def weight_version(self) -> str:
        return self.version

    def weight_checksums(self) -> list[dict[str, str]]:
        from slimish.weight_sync.checksums import tensor_checksum
        from slimish.weight_sync.engine_loader import parse_slot
        from slimish.weight_sync.tile_hash import tile_hash

        if self.fail == "corrupt":  # one slot of rank 1 (EP rank 1's expert, sent by its owner) changed, once
            self.fail = ""
            slot = max((name for name in self.held[1] if name.startswith("model.layers.0.mlp.experts.w13_weight[")),
                       key=lambda name: parse_slot(name)[1])
            self.held[1][slot] = self.held[1][slot] + 1
        checksum = tile_hash if self.device == "cuda" else tensor_checksum  # as SGLang hashes on that device
        out = []
        for held in self.held:
            slots: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
            sums = {}
            for name, tensor in held.items():
                param, slot = parse_slot(name)
                if slot is None:
                    sums[name] = checksum(tensor)
                else:
                    slots[param][slot] = tensor
            for param, by_slot in slots.items():
                sums[param] = checksum(torch.stack([by_slot[k] for k in sorted(by_slot)]))
            out.append(sums)
        return out

    def close(self):
        pass


def _funnel():
    from slimish.weight_sync.sender import WeightSender

    class Funnel(WeightSender):
        """The route through rank 0: every expert, and every later stage's tensors (sharded: rank 0 cuts them)."""
        several_senders_possible = False
        stage_senders = False
    return Funnel


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--rank", "--world-size", "--port", "--tp"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--etp", type=int, default=1, help="expert tensor parallelism")
    parser.add_argument("--ep", type=int, default=2, help="expert parallelism")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallelism")
    parser.add_argument("--engine-ep", type=int, default=2, help="the stand-in engine's expert parallelism")
    parser.add_argument("--engine-device", default="cpu", help="the stand-in engine's device (cuda: the tile hash)")
    parser.add_argument("--no-verify", action="store_true", help="weight_sync.verify=false")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--transport", required=True)
    parser.add_argument("--faults", nargs="*", default=[],
                        help="'first' and/or 'owner': a sync that fails there; 'tp': engines of another TP size; "
                             "'corrupt': an engine that reports a changed expert slot; "
                             "'frozen' / 'killed' (broadcast): engine rank 1 frozen / killed inside the owner's "
                             "broadcast, the sync released by the stand-in's watchdog")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # "killed": a spare rank process stands in for the restarted engine's rank 1
    ranks = start_ranks(3 if "killed" in args.faults else 2) \
        if args.rank == 0 and args.transport == "broadcast" else None
    if "frozen" in args.faults:  # the frozen engine never answers: the sync lets the survivors go within 1 s, not 10
        from slimish.weight_sync import transport as transport_module

        transport_module.LET_GO_S = 1.0

    from slimish.config import load_config
    from slimish.megatron_bridge.bridge import load_hf_weights
    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.trainer.model import build_gpt_model
    from slimish.trainer.parallel import ParallelLayout, init_parallel, shutdown_parallel
    from slimish.weight_sync.sender import WeightSender
    from tests.conftest import REPO

    Funnel = _funnel()  # noqa: N806 - a class

    init_parallel(ParallelLayout(rank=args.rank, world_size=args.world_size, tensor_parallel=args.tp,
                                 pipeline_parallel=args.pp, expert_parallel=args.ep, expert_tensor_parallel=args.etp),
                  master_addr="127.0.0.1", master_port=args.port, backend="gloo", seed=1234)
    arch = architecture_from_hf(read_hf_config(args.model))
    model = build_gpt_model(arch, tensor_parallel=args.tp, pipeline_parallel=args.pp, expert_parallel=args.ep,
                            expert_tensor_parallel=args.etp).eval()
    load_hf_weights(model, args.model, arch)
    out = Path(args.out)
    cfg = load_config(REPO / "configs" / "quickstart_cpu.yaml",
                      [f"model.hf_path={args.model}", f"weight_sync.transport={args.transport}",
                       "weight_sync.bucket_mb=0.02", f"run.output_dir={out}", "run.name=owners",
                       # broadcast: an engine rank that never joins a group fails its join within 5 s
                       *(["weight_sync.bucket_timeout_s=5"] if args.transport == "broadcast" else []),
                       f"weight_sync.verify={str(not args.no_verify).lower()}"], files=False)
    results = {}
    for route in ("funnel", "owners", *args.faults):
        engine = Engine("http://127.0.0.1:1", tp=2, ep=args.engine_ep, fail=route if route in args.faults else "",
                        ranks=ranks, device=args.engine_device)
        kind = Funnel if route == "funnel" else WeightSender
        sender = kind(cfg, arch, rank=args.rank, pipeline_parallel=args.pp, expert_parallel=args.ep,
                      new_client=lambda url, api_key, e=engine: e)
        engine.watchdog = sender.release
        failed = ""
        if route == "tp":  # the engines run another TP size: rank 0 raises naming the key, the others return
            try:
                connected = sender.connect(engine_urls=[engine.url], engine_tp=2, master_addr="127.0.0.1")
            except ValueError as exc:
                connected = str(exc)
            results[route] = {"failed": connected}
            dist.barrier()
            continue
        sender.connect(engine_urls=[engine.url], engine_tp=2, master_addr="127.0.0.1")
        try:
            metrics = sender.send(model, version=1)
        except RuntimeError as exc:  # rank 0 only: the owners are told to give up, and return
            failed, metrics = str(exc), {}
            engine.thaw()
            if route == "killed":  # the restarted engine's rank 1
                ranks[1] = ranks.pop()
        if route in args.faults:  # then the sync again, whole, on a new connection (as the job does)
            if args.rank == 0 and route in ("frozen", "killed"):  # the engine the job restarts (a fresh stand-in)
                engine = Engine(engine.url, tp=2, ep=args.engine_ep, ranks=ranks)
                sender.new_client = lambda url, api_key, e=engine: e
            sender.connect(engine_urls=[engine.url], engine_tp=2, master_addr="127.0.0.1")
            metrics = sender.send(model, version=2)
        sender.close()
        dist.barrier()
        if args.rank == 0:
            results[route] = {"held": engine.held, "metrics": metrics, "failed": failed}
    if args.rank == 0:
        torch.save(results, out / "result.pt")
    elif "tp" in results:
        torch.save(results["tp"], out / "tp_rank1.pt")
    for conn in ranks or []:
        conn.send(None)
    shutdown_parallel()


if __name__ == "__main__":
    main()
