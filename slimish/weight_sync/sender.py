"""The sending end of the weight sync on one trainer rank: `WeightSender`.

It decides which trainer ranks send to which engines, over which process groups and ports, with which expected
checksums; it keeps the bookkeeping of a failed send (how long it stalled, which engines hung) and releases a send
from another thread. The trainer holds one and hands it its model at each sync; nothing else about the sync lives in
the trainer. Who sends:
- by default trainer rank 0 sends the whole model to every engine (`export_full_hf_tensors`: later pipeline stages'
  layers reach it over the pipeline group, the TP / EP gathers involve every rank of the replica);
- on the sharded route with pipeline or expert parallelism, several senders (`slimish.weight_sync.owners`, decided
  by rank 0 at connect, `_senders_route`): every later stage's leader sends its own stage (weight_sync.stage_senders,
  any transport), and with expert parallelism each expert-parallel rank's ETP rank 0 its own experts (where the
  checksums allow, `owners_fit`); each stages its buckets itself (broadcast: sends them over per-rank groups of its
  own), and rank 0 posts what names them; nothing crosses the pipeline group;
- on the full route with stage senders (broadcast transport, pipeline parallel) every later stage's leader joins a
  group of its own with the engines and sends its own stage whole (`slimish.weight_sync.stages`), taking turns with
  rank 0's buckets;
- colocated with the tensor transport (no expert parallelism, whose export spans replicas, and experts split as
  tensor_parallel splits the rest), the source rank of every data-parallel replica sends to the engines on its
  replica's GPUs, from its own GPU by CUDA IPC.
Other ranks only take part in the export's gathers.

What each engine rank receives (`sharded_layout`, weight_sync.sharded): with engines of several tensor-parallel ranks,
only the parameters it holds, in SGLang's layout (`slimish.weight_sync.sharding`), over every transport (broadcast:
on gloo under 'auto'); otherwise, and as the fallback, the whole model.

`sync_to` builds the rank-0 sync (`WeightSync`) of one host's engines, `local_context` the context of any sender
there: what tests and benchmarks that send tensors of their own (not a trainer's model) use.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import torch

from slimish.collectives import resolve_backend
from slimish.config.schema import JobConfig
from slimish.engines.client import EngineClient
from slimish.megatron_bridge.full_export import (
    export_full_hf_tensors,
    export_owned_hf_tensors,
    export_stage_hf_tensors,
    in_source_replica,
)
from slimish.network import free_port, node_ip
from slimish.weight_sync.sync import WeightSync, drain
from slimish.weight_sync.transport import TransportContext


class WeightSender:
    """One trainer rank's part of every weight sync of a job (`cfg`, model `arch`). `rank`, `pipeline_parallel`
    and `expert_parallel`: this rank's place in the trainer's layout (Megatron's parallel state is initialised).
    `new_client(url, api_key=...)` makes each engine's client (`EngineClient`; a stand-in in unit tests)."""

    def __init__(self, cfg: JobConfig, arch, *, rank: int, pipeline_parallel: int = 1, expert_parallel: int = 1,
                 new_client: Callable[..., EngineClient] = EngineClient):
        self.cfg, self.arch, self.rank = cfg, arch, rank
        self.pipeline_parallel, self.expert_parallel = pipeline_parallel, expert_parallel
        self.new_client = new_client
        self._sync: WeightSync | None = None  # rank 0 (or a replica's source): the engine protocol
        self._stage_sender = None             # a later pipeline stage's leader, with stage senders
        self._stage_links: list = []          # rank 0: the other senders' links
        self._sharding = None
        self._route = "full"   # this connection's senders (every rank knows): "full", "stages" or "owned"
        self._control = None   # the senders' messages' group (`_control_group`)
        self._groups_made = 0
        self._nonce: str | None = None  # the job's, agreed at the first connect, in every group name (`_group_name`)
        self._api_key: str | None = None
        self._stalled_s = 0.0   # failed sends since the last whole one: how long each had made no progress
        self.hung: list[str] = []  # the last failed send: engines that had not answered by a bucket's deadline

    # ------------------------------------------------------------------------------------------------ who sends
    @property
    def replica_senders(self) -> bool:
        """Colocated with the tensor transport (and no expert parallelism, nor an expert tensor parallelism other
        than tensor_parallel: their export spans replicas): every data-parallel replica exports the model, and its
        source rank sends it to the engines on the replica's GPUs, from its own GPU by CUDA IPC; else rank 0 sends
        to every engine."""
        par = self.cfg.parallel
        return (self.cfg.placement.colocate and self.cfg.weight_sync.transport == "tensor"
                and self.expert_parallel == 1 and par.expert_tensor_parallel in (0, par.tensor_parallel))

    @property
    def stage_senders(self) -> bool:
        ws = self.cfg.weight_sync
        return ws.transport == "broadcast" and ws.stage_senders and self.pipeline_parallel > 1

    def replica_ranks(self) -> list[int]:
        """The global ranks of this rank's data-parallel replica (its model-parallel group: tensor x pipeline),
        in order; the first holds tensor- and pipeline-parallel rank 0, where the replica's export ends."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return [self.rank]
        return sorted(dist.get_process_group_ranks(ps.get_model_parallel_group()))

    def sending_rank(self) -> int:
        """The rank that sends this rank's colocated engine its weights (that engine must see its GPU)."""
        return self.replica_ranks()[0] if self.replica_senders else 0

    # ---------------------------------------------------------------------------------------------- connect
    def connect(self, *, engine_urls: list[str], engine_tp: int, master_addr: str, api_key: str | None = None,
                engines_by_rank: list[str | None] | None = None) -> dict:
        """Join the process groups with the engines `engine_urls` (rank 0's at `master_addr`; calls carry
        `api_key`) that this rank sends over; colocated with replica senders, `engines_by_rank[r]` is the engine on
        trainer rank r's GPU (None: not synced now). Every rank calls it. Called again when the engines change (one
        died, a restarted one joins): the old groups are torn down and new ones, under new names and on free ports,
        replace them."""
        self._groups_made += 1
        if self._nonce is None:
            self._nonce = _shared_nonce()
        self._api_key = api_key
        self._sharding = None  # the engines' layout, read once per connect (`_engine_sharding`)
        self.close()
        if self.replica_senders and engines_by_rank is not None:
            replica = self.replica_ranks()
            own = [engines_by_rank[r] for r in replica if r < len(engines_by_rank) and engines_by_rank[r]]
            if self.rank != replica[0] or not own:
                return {}
            return self._connect_rank0(own, engine_tp, node_ip(), stages=[])
        if self.several_senders_possible:
            return self._connect_senders(engine_urls, engine_tp, master_addr)
        if not self.stage_senders:
            return self._connect_rank0(engine_urls, engine_tp, master_addr, stages=[]) if self.rank == 0 else {}
        return self._connect_stages(engine_urls, engine_tp, master_addr)

    def _connect_stages(self, engine_urls: list[str], engine_tp: int, master_addr: str) -> dict:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from slimish.megatron_bridge.full_export import is_stage_leader, stage_leader_rank
        from slimish.weight_sync.stages import StageLink, StageSender

        stage, pp_group = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_group()
        leader = in_source_replica() and is_stage_leader()
        metrics: dict = {}
        for turn in range(self.pipeline_parallel):
            # One stage's group at a time: an engine joins groups in the order their requests reach it, and a
            # group's rendezvous needs every engine.
            if leader and stage == turn == 0:
                links = [StageLink(stage=s, rank=stage_leader_rank(s), group=pp_group, group_name=self._group_name(s))
                         for s in range(1, self.pipeline_parallel)]
                metrics = self._connect_rank0(engine_urls, engine_tp, master_addr, stages=links)
            elif leader and stage == turn:
                self._stage_sender = StageSender(
                    stage=stage, context=self._context(engine_tp, node_ip(), free_port(), self._group_name(stage)),
                    engine_urls=engine_urls, bucket_bytes=int(self.cfg.weight_sync.bucket_mb * 2**20),
                    coordinator=stage_leader_rank(0), group=pp_group,
                    expected_checksums=self._expected_checksums(self._engine_sharding(engine_urls, engine_tp)),
                    new_client=self.new_client)
                self._stage_sender.connect()
            dist.barrier()
        return metrics

    # ------------------------------------------------- several senders: stages and expert owners (owners.py)
    @property
    def several_senders_possible(self) -> bool:
        """Whether the sync may go from several trainer ranks, decided at connect (`_connect_senders`): each later
        pipeline stage's leader sends its own stage (weight_sync.stage_senders) and each expert-parallel rank's
        owner its own experts, on the sharded route (`slimish.weight_sync.owners`). Needs pipeline or expert
        parallelism, rank 0 sending to every engine (not the replica senders) and a transport they send over."""
        from slimish.weight_sync.owners import TRANSPORTS as OWNER_TRANSPORTS

        ws = self.cfg.weight_sync
        return ((self.expert_parallel > 1 or (self.pipeline_parallel > 1 and ws.stage_senders))
                and not self.replica_senders and ws.transport in OWNER_TRANSPORTS)

    def _connect_senders(self, engine_urls: list[str], engine_tp: int, master_addr: str) -> dict:
        """Every rank: rank 0 reads the engines' layout and decides the route (`_senders_route`); then rank 0
        connects with a link to each other sender, and each sender makes its `OwnerSender`. Where neither stages
        nor owners may send, broadcast's stage senders (the whole model, `stages`) or rank 0 send everything."""
        import torch.distributed as dist

        from slimish.megatron_bridge.full_export import is_stage_leader, owns_in_owned_export
        from slimish.weight_sync.owners import OwnerSender

        control = self._control_group()
        source = in_source_replica()
        me = {"node": node_ip(), "owner": source and owns_in_owned_export(),
              "leader": source and is_stage_leader(), "stage": _pipeline_rank()}
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, me, group=control)
        decision, failure = [None], None
        if self.rank == 0:
            try:
                sharding = self._engine_sharding(engine_urls, engine_tp)
                route = self._senders_route(sharding, ranks)
            except Exception as exc:  # noqa: BLE001 - raised below, once the others are told (they return)
                failure, sharding, route = exc, None, None
            decision = [(route, sharding, failure is not None)]
        dist.broadcast_object_list(decision, src=0, group=control)
        route, sharding, failed = decision[0]
        self._route = route or "full"
        if failure is not None:
            raise failure
        if failed:
            return {}
        if route is None:
            if self.stage_senders:
                return self._connect_stages(engine_urls, engine_tp, master_addr)
            return self._connect_rank0(engine_urls, engine_tp, master_addr, stages=[]) if self.rank == 0 else {}
        senders = [rank for rank, info in enumerate(ranks) if rank and info[_SENDS[route]]]
        if self.rank == 0:
            return self._connect_rank0(engine_urls, engine_tp, master_addr, stages=_links(senders, ranks, control))
        if self.rank not in senders:
            return {}
        ws = self.cfg.weight_sync
        # broadcast: the engines meet the sender's own groups at its address (rank 0's where they share a node).
        address = master_addr if ranks[self.rank]["node"] == ranks[0]["node"] else node_ip()
        self._stage_sender = OwnerSender(
            rank=self.rank, transport=ws.transport, layout=self.sharded_layout(sharding), engines=len(engine_urls),
            bucket_bytes=int(ws.bucket_mb * 2**20), coordinator=0, group=control, disk_dir=self.disk_dir(),
            expected_checksums=self._expected_checksums(sharding),
            context=self._context(engine_tp, address, 0, self._group_name()))
        return {}

    def _senders_route(self, sharding, ranks: list[dict]) -> str | None:
        """Rank 0: "owned" (each stage's leader its stage outside the experts, each expert-parallel rank's owner its
        experts: `export_owned_hf_tensors`), "stages" (each stage's leader its whole stage, the experts gathered to
        it: `export_stage_hf_tensors`) or None (rank 0 sends everything, or broadcast's stage senders the whole
        model). Both need the sharded route. The owners need `owners_fit` (checksums an owner can predict); the
        stages, and the owners with pipeline parallelism, need weight_sync.stage_senders. Over tensor the engines
        map the senders' memory: every sender on rank 0's node, as the engines are."""
        from slimish.weight_sync.owners import owners_fit

        layout = self.sharded_layout(sharding)
        if layout is None:
            return None
        predicted = self._expected_checksums(sharding) is not None
        stages = self.pipeline_parallel > 1 and self.cfg.weight_sync.stage_senders
        # Owners send from every stage, so with pipeline parallelism they need stage senders too.
        owners = (self.expert_parallel > 1 and (self.pipeline_parallel == 1 or stages)
                  and owners_fit(layout, self.expert_parallel, predicted=predicted))
        route = "owned" if owners else "stages" if stages else None
        if route and self.cfg.weight_sync.transport == "tensor" and any(
                info["node"] != ranks[0]["node"] for info in ranks if info[_SENDS[route]]):
            return None
        return route

    def _control_group(self):
        """A gloo group of every rank, made at the first connect (every rank connects): the senders' small messages
        to rank 0 travel on it, on the host (the pipeline and expert groups are NCCL on GPUs)."""
        import torch.distributed as dist

        if self._control is None:
            self._control = dist.new_group(backend="gloo")
        return self._control

    def _connect_rank0(self, engine_urls: list[str], engine_tp: int, master_addr: str, stages: list) -> dict:
        from slimish.hooks import load_function

        ws = self.cfg.weight_sync
        port = ws.master_port if self._groups_made == 1 and ws.master_port else free_port()
        self._stage_links = stages
        sharding = self._engine_sharding(engine_urls, engine_tp)
        # Senders of shards are not broadcast's whole-stage senders: the route's rules apply as without them.
        stage_links = [link for link in stages if not link.sends_shards]
        self._sync = WeightSync(transport=ws.transport, context=self._context(engine_tp, master_addr, port,
                                                                               self._group_name()),
                                engine_urls=engine_urls, bucket_bytes=int(ws.bucket_mb * 2**20), verify=ws.verify,
                                expected_checksums=self._expected_checksums(sharding),
                                layout=self.sharded_layout(sharding, stages=bool(stage_links)),
                                after_bucket=load_function(ws.after_bucket_hook) if ws.after_bucket_hook else None,
                                in_flight=load_function(ws.in_flight_hook) if ws.in_flight_hook else None,
                                new_client=self.new_client, rank=self.rank)
        t0 = time.monotonic()
        self._sync.connect()
        return {"time_connect_s": time.monotonic() - t0}

    def _group_name(self, stage: int = 0) -> str:
        """A name no other connection uses, of this sender or of an earlier one: an engine that outlived its trainer
        (attached, or a resumed job's) still holds the old connection's groups by name, and would take a request
        naming one of them for that old group, whose sender is gone."""
        suffix = f"_stage{stage}" if stage else ""
        return f"slimish_weight_sync_{self._nonce}_{self._groups_made}{suffix}"

    def _context(self, engine_tp: int, master_addr: str, master_port: int, group_name: str) -> TransportContext:
        ws = self.cfg.weight_sync
        return TransportContext(master_addr=master_addr, master_port=master_port,
                                backend=resolve_backend(self.cfg.parallel.backend), group_name=group_name,
                                engine_tp=engine_tp, disk_dir=self.disk_dir(), api_key=self._api_key,
                                bucket_timeout_s=ws.bucket_timeout_s, min_bandwidth_mib_s=ws.min_bandwidth_mib_s)

    def disk_dir(self) -> str:
        """Where the disk transport writes this run's shards (`slimish.run_layout.weight_sync_root`)."""
        from slimish.run_layout import weight_sync_root

        run = self.cfg.run
        return str(weight_sync_root(self.cfg.weight_sync.disk_dir, Path(run.output_dir) / run.name))

    def _engine_sharding(self, engine_urls: list[str], engine_tp: int):
        """How the engines shard their parameters, as the first of `engine_urls` says (its /server_info, asked once
        per connect); raises if its tensor-parallel size is not `engine_tp` (the weight-sync group's ranks follow
        it)."""
        from slimish.weight_sync.sharding import sharding_of

        if self._sharding is not None and self._sharding[0] == engine_urls[0]:
            sharding = self._sharding[1]
        else:
            sharding = sharding_of(engine_urls[0], api_key=self._api_key, new_client=self.new_client)
            self._sharding = (engine_urls[0], sharding)
        if sharding.tp != engine_tp:
            raise ValueError(f"rollout.engine.tensor_parallel: got {engine_tp}, but engine {engine_urls[0]} runs "
                             f"--tp-size {sharding.tp}; set rollout.engine.tensor_parallel={sharding.tp}")
        return sharding

    def _expected_checksums(self, sharding):
        """What makes the expected engine checksums of the tensors a sender sends (None: not verifying, or layout not
        predicted), for engines sharded as `sharding`."""
        from slimish.weight_sync.checksums import ExpectedChecksums, layout_supported

        if not (self.cfg.weight_sync.verify and layout_supported(self.arch, sharding)):
            return None
        return functools.partial(ExpectedChecksums, self.arch, getattr(torch, self.cfg.model.dtype), sharding)

    def sharded_layout(self, sharding, *, stages: bool = False):
        """The route (`weight_sync.sharded`): the engines' `EngineLayout` when each engine rank is sent only its own
        parameters, None when every rank gets the whole model (under 'auto': engines of one rank, and broadcast where
        `Transport.shards_under_auto` says no; wherever the sharded route cannot run: raised as a ConfigError under
        'on')."""
        from slimish.config.engine_flags import SHARD_DIRECT
        from slimish.config.errors import ConfigError
        from slimish.weight_sync.sharding import EngineLayout, layout_supported
        from slimish.weight_sync.sync import TRANSPORTS

        ws = self.cfg.weight_sync
        backend = resolve_backend(self.cfg.parallel.backend)
        if ws.sharded == "off" or (ws.sharded == "auto" and (
                sharding.tp == 1 or not TRANSPORTS[ws.transport].shards_under_auto(backend))):
            return None
        loader = TRANSPORTS[ws.transport].shard_loader
        why_not = (f"the '{ws.transport}' transport sends the whole model" if not TRANSPORTS[ws.transport].shards
                   else "stage senders send the whole model" if stages
                   else f"the engines do not list {loader} in --custom-weight-loader (slimish starts its engines "
                        f"with it; add it to attached ones)" if loader and loader not in sharding.loaders
                   else f"the engine layout of {self.arch.family} on {sharding} is not known"
                   if not layout_supported(self.arch, sharding) else "")
        layout = None if why_not else EngineLayout(self.arch, sharding, expert_slots=self.expert_slots(sharding))
        if layout is not None and not layout.direct_loadable and ws.transport == "tensor" \
                and SHARD_DIRECT not in sharding.loaders:
            why_not, layout = (f"{self.arch.family}'s MLA weights are post-processed after loading, which needs "
                               f"{SHARD_DIRECT} in the engines' --custom-weight-loader"), None
        if why_not and ws.sharded == "on":
            raise ConfigError("weight_sync.sharded", f"'on' cannot run here: {why_not}; use 'auto' or 'off'")
        return layout

    def expert_slots(self, sharding) -> bool:
        """Whether the sharded route sends experts one at a time into their slots (`EngineShards`): where the
        engines list slimish's loader of this transport (the tensor transport's is `SHARD_DIRECT`; the others'
        are required by the sharded route anyway). Else a rank's stacked expert parameters travel whole."""
        from slimish.config.engine_flags import SHARD_DIRECT
        from slimish.weight_sync.sync import TRANSPORTS

        transport = self.cfg.weight_sync.transport
        return (SHARD_DIRECT if transport == "tensor" else TRANSPORTS[transport].shard_loader) in sharding.loaders

    # ------------------------------------------------------------------------------------------------- send
    def send(self, module, version: int) -> dict:
        """Send `module`'s weights (the trainer's Megatron model: this rank's model chunks) to the connected engines
        as weight version
        `version`; every rank calls it (the export's gathers span the replica). Ranks outside the sending replicas
        return {} at once; a failed send raises, after recording `hung` and the stall (reported with the next whole
        send as time_sync_stalled_s)."""
        if not (in_source_replica() or self.replica_senders):
            return {}
        if self._route == "owned":
            tensors = export_owned_hf_tensors(module, self.arch)
        elif self._route == "stages" or self.stage_senders:
            tensors = export_stage_hf_tensors(module, self.arch)
        else:
            tensors = export_full_hf_tensors(module, self.arch)
        try:
            if self._sync is not None:
                try:
                    metrics = self._sync.send(tensors, version=str(version), stages=self._stage_links)
                except Exception:
                    self._stalled_s += self._sync.stalled_s
                    self.hung = list(self._sync.hung)
                    raise
                stalled, self._stalled_s = self._stalled_s, 0.0
                return {**metrics, "sync_engines": len(self._sync.clients), "time_sync_stalled_s": stalled}
            if self._stage_sender is not None:
                self._stage_sender.send(tensors)
            return {}
        finally:
            drain(tensors)

    def release(self, reason: str) -> None:
        """Give up the send in progress wherever it waits (`WeightSync.release`), from any thread: an engine of the
        sync died or froze. A no-op between syncs."""
        for sender in (self._sync, self._stage_sender):
            if sender is not None:
                sender.release(reason)

    def close(self) -> None:
        """Tear down this rank's groups with the engines (a later `connect` makes new ones)."""
        for sender in (self._sync, self._stage_sender):
            if sender is not None:
                sender.close()
        self._sync = self._stage_sender = None


#: Which ranks send on each route of several senders, by what they said of themselves at connect.
_SENDS = {"owned": "owner", "stages": "leader"}


def _links(senders: list[int], ranks: list[dict], control) -> list:
    """Rank 0's links to the other `senders` (each rank's `ranks[r]`: its stage, whether it leads it), in the order
    that `WeightSync` waits for and releases them: every later stage's leader first (it takes turns with rank 0 from
    the start), then the owners (a first-stage owner after rank 0's own export, a later stage's after its leader has
    passed the stage's gathers outside the experts, `OwnerLink.ready`)."""
    from slimish.weight_sync.owners import OwnerLink

    leaders = {ranks[rank]["stage"]: OwnerLink(stage=ranks[rank]["stage"], rank=rank, group=control)
               for rank in senders if ranks[rank]["leader"]}
    owners = [OwnerLink(stage=ranks[rank]["stage"], rank=rank, group=control, after_own=ranks[rank]["stage"] == 0,
                        leader=leaders.get(ranks[rank]["stage"]))
              for rank in senders if not ranks[rank]["leader"]]
    return [*leaders.values(), *owners]


def _pipeline_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_rank() if ps.model_parallel_is_initialized() else 0


def _shared_nonce() -> str:
    """A random token, the same on every trainer rank (rank 0's; a collective where torch.distributed runs): the
    stage senders' group names, which rank 0 names in its requests, must be the leaders' own."""
    import torch.distributed as dist

    token = [secrets.token_hex(4)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(token, src=0)
    return token[0]


def local_context(group_name: str, *, engine_tp: int = 1, disk_dir: str = "", api_key: str | None = None,
                  master_port: int = 0, bucket_timeout_s: float = 60.0,
                  min_bandwidth_mib_s: float = 32.0) -> TransportContext:
    """The transport context of a sender to engines on this host: gloo from 127.0.0.1 (a free port unless
    `master_port`)."""
    return TransportContext(master_addr="127.0.0.1", master_port=master_port or free_port(), backend="gloo",
                            group_name=group_name, engine_tp=engine_tp, disk_dir=disk_dir, api_key=api_key,
                            bucket_timeout_s=bucket_timeout_s, min_bandwidth_mib_s=min_bandwidth_mib_s)


def sync_to(engine_urls: list[str], *, transport: str, group_name: str, bucket_bytes: int, engine_tp: int = 1,
            disk_dir: str = "", api_key: str | None = None, master_port: int = 0, bucket_timeout_s: float = 60.0,
            min_bandwidth_mib_s: float = 32.0, **options) -> WeightSync:
    """A rank-0 `WeightSync` (not connected) to engines on this host (`local_context`); `options` go to `WeightSync`
    (expected_checksums, verify, in_flight, after_bucket, new_client). For senders of tensors that are not a
    trainer's model: tests and benchmarks."""
    context = local_context(group_name, engine_tp=engine_tp, disk_dir=disk_dir, api_key=api_key,
                            master_port=master_port, bucket_timeout_s=bucket_timeout_s,
                            min_bandwidth_mib_s=min_bandwidth_mib_s)
    return WeightSync(transport=transport, context=context, engine_urls=engine_urls, bucket_bytes=bucket_bytes,
                      **options)
