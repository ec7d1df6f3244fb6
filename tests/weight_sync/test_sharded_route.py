"""Which route the sender takes (`WeightSender.sharded_layout`, weight_sync.sharded): sharded where the engines have
several tensor-parallel ranks, the transport sends shards (broadcast: on gloo) and SGLang
loads the layout by name; the full model otherwise; 'on' where the sharded route cannot run is a one-line
ConfigError naming the key, at check-config where the config alone tells (DP attention), at connect where the
engines tell (the model's MLA, an engine without slimish's loader, MLA over tensor without slimish's load_by_name)."""

from __future__ import annotations

import json

import pytest

from slimish.config import ConfigError, load_config
from slimish.config.engine_flags import SHARD_DIRECT, SHARD_LOADER, SHARD_RECEIVER
from slimish.megatron_bridge.hf_config import architecture_from_hf
from slimish.weight_sync.sender import WeightSender
from slimish.weight_sync.sharding import EngineSharding
from tests.conftest import REPO
from tests.megatron_bridge.real_configs import DEEPSEEK_V3, QWEN3_8B, QWEN3_30B_A3B

WITH_LOADER = EngineSharding(tp=2, loaders=(SHARD_LOADER,))
BOTH_LOADERS = EngineSharding(tp=2, loaders=(SHARD_LOADER, SHARD_RECEIVER))


def sender(tmp_path, hf_config: dict, *overrides: str, pipeline_parallel: int = 1) -> WeightSender:
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    cfg = load_config(REPO / "configs" / "quickstart_cpu.yaml", [f"model.hf_path={tmp_path}", *overrides],
                      files=False)
    return WeightSender(cfg, architecture_from_hf(hf_config), rank=0, pipeline_parallel=pipeline_parallel)


@pytest.mark.parametrize(("overrides", "sharding", "sharded"), [
    (["weight_sync.transport=tensor"], WITH_LOADER, True),
    (["weight_sync.transport=disk"], WITH_LOADER, True),
    (["weight_sync.transport=tensor"], EngineSharding(tp=1), False),  # one rank: nothing to shard under auto
    (["weight_sync.transport=tensor", "weight_sync.sharded=on"], EngineSharding(tp=1), True),
    (["weight_sync.transport=tensor", "weight_sync.sharded=off"], WITH_LOADER, False),
    (["weight_sync.transport=broadcast"], BOTH_LOADERS, True),  # per-rank groups, joined by receive_shard
    (["weight_sync.transport=broadcast"], WITH_LOADER, False),  # an engine without receive_shard
    (["weight_sync.transport=broadcast", "weight_sync.sharded=on"], BOTH_LOADERS, True),
    (["weight_sync.transport=broadcast", "weight_sync.sharded=on", "parallel.pipeline_parallel=2",
      "parallel.num_trainer_ranks=2"], BOTH_LOADERS, "stage senders"),
    (["weight_sync.transport=disk"], EngineSharding(tp=2), False),  # an engine without slimish's loader
], ids=["tensor", "disk", "one-rank", "one-rank-on", "off", "broadcast", "broadcast-without-receiver",
        "broadcast-on", "broadcast-stages-on", "disk-without-loader"])
def test_the_route(tmp_path, overrides, sharding, sharded):
    weight_sender = sender(tmp_path, QWEN3_8B, *overrides)
    if isinstance(sharded, str):  # refused under 'on', naming why
        with pytest.raises(ConfigError, match=rf"weight_sync.sharded.*{sharded}"):
            weight_sender.sharded_layout(sharding, stages=True)
        return
    layout = weight_sender.sharded_layout(sharding)
    assert (layout is not None) == sharded
    if sharded:
        assert layout.sharding == sharding


def test_the_senders_route(tmp_path, monkeypatch):
    """With pipeline parallelism on the sharded route, every stage's leader sends its stage ("stages"), and with
    trainer expert parallelism each owner its experts ("owned": with checksums only where an owner can predict them,
    `owners_fit`; with pipeline parallelism only with stage senders); off the sharded route (NCCL under 'auto') no
    route of several senders, and broadcast's stage senders send the whole model. Over tensor, every sender must be
    on rank 0's node."""
    one_node = [{"node": "n1", "leader": True, "owner": True}] * 4
    pp2 = sender(tmp_path, QWEN3_8B, "weight_sync.transport=broadcast", "parallel.pipeline_parallel=2",
                 "parallel.num_trainer_ranks=2", pipeline_parallel=2)
    assert pp2._senders_route(BOTH_LOADERS, one_node) == "stages"
    assert sender(tmp_path, QWEN3_8B, "weight_sync.transport=broadcast", "parallel.pipeline_parallel=2",
                  "parallel.num_trainer_ranks=2", "weight_sync.stage_senders=false",
                  pipeline_parallel=2)._senders_route(BOTH_LOADERS, one_node) is None
    tensor = sender(tmp_path, QWEN3_8B, "weight_sync.transport=tensor", "parallel.pipeline_parallel=2",
                    "parallel.num_trainer_ranks=2", pipeline_parallel=2)
    assert tensor._senders_route(WITH_LOADER, one_node) == "stages"
    assert tensor._senders_route(WITH_LOADER, [*one_node[:1], {"node": "n2", "leader": True, "owner": True}]) is None

    def moe(*overrides: str, pipeline_parallel: int = 1) -> WeightSender:
        (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
        cfg = load_config(REPO / "configs" / "quickstart_cpu.yaml", [f"model.hf_path={tmp_path}", *overrides],
                          files=False)
        return WeightSender(cfg, architecture_from_hf(QWEN3_30B_A3B), rank=0, pipeline_parallel=pipeline_parallel,
                            expert_parallel=2)

    slots = (SHARD_LOADER, SHARD_RECEIVER, SHARD_DIRECT)
    cpu_ep1, cpu_ep2 = EngineSharding(tp=2, loaders=slots), EngineSharding(tp=2, ep=2, loaders=slots)
    cuda_ep1 = EngineSharding(tp=2, loaders=slots, device="cuda")
    assert moe("weight_sync.transport=disk")._senders_route(cpu_ep2, one_node) == "owned"
    assert moe("weight_sync.transport=disk")._senders_route(cpu_ep1, one_node) is None  # SHA-256: through rank 0
    assert moe("weight_sync.transport=disk")._senders_route(cuda_ep1, one_node) == "owned"  # the tile hash combines
    assert moe("weight_sync.transport=disk", "weight_sync.verify=false")._senders_route(cpu_ep1, one_node) == "owned"
    pp2_moe = ["weight_sync.transport=disk", "parallel.pipeline_parallel=2", "parallel.num_trainer_ranks=4"]
    assert moe(*pp2_moe, pipeline_parallel=2)._senders_route(cpu_ep2, one_node) == "owned"
    assert moe(*pp2_moe, pipeline_parallel=2)._senders_route(cpu_ep1, one_node) == "stages"
    assert moe(*pp2_moe, "weight_sync.stage_senders=false",
               pipeline_parallel=2)._senders_route(cpu_ep2, one_node) is None
    monkeypatch.setattr("slimish.weight_sync.sender.resolve_backend", lambda backend: "nccl")
    assert pp2._senders_route(BOTH_LOADERS, one_node) is None  # full-route stage senders


def test_auto_keeps_broadcast_on_the_full_path_with_stage_senders_or_over_nccl(tmp_path, monkeypatch):
    """Stage senders send the whole model (each stage its own layers), and over NCCL the per-rank groups'
    communicators are set up lazily inside the first broadcast's host call, out of reach of any release (issue 44,
    docs/weight-sync.md): 'auto' takes the full path there, and the other transports, which use no group, shard over
    NCCL too."""
    stages = sender(tmp_path, QWEN3_8B, "weight_sync.transport=broadcast", "parallel.pipeline_parallel=2",
                    "parallel.num_trainer_ranks=2", pipeline_parallel=2)
    assert stages.stage_senders and stages.sharded_layout(BOTH_LOADERS, stages=True) is None
    monkeypatch.setattr("slimish.weight_sync.sender.resolve_backend", lambda backend: "nccl")
    assert sender(tmp_path, QWEN3_8B, "weight_sync.transport=broadcast").sharded_layout(BOTH_LOADERS) is None
    assert sender(tmp_path, QWEN3_8B, "weight_sync.transport=tensor").sharded_layout(WITH_LOADER) is not None
    on = sender(tmp_path, QWEN3_8B, "weight_sync.transport=broadcast", "weight_sync.sharded=on")
    assert on.sharded_layout(BOTH_LOADERS) is not None


def test_mla_over_tensor_needs_slimishs_loader(tmp_path):
    """DeepSeek-V3's w_kc / w_vc are derived after loading, which SGLang's stock direct copy does not run: over the
    tensor transport the engines must list slimish's load_by_name (the disk and broadcast loaders post-process
    anyway); without it, auto takes the full path and 'on' is refused naming it."""
    by_name = EngineSharding(tp=2, loaders=(SHARD_DIRECT,))
    assert sender(tmp_path, DEEPSEEK_V3, "weight_sync.transport=tensor").sharded_layout(by_name) is not None
    assert sender(tmp_path, DEEPSEEK_V3, "weight_sync.transport=tensor").sharded_layout(WITH_LOADER) is None
    on = sender(tmp_path, DEEPSEEK_V3, "weight_sync.transport=tensor", "weight_sync.sharded=on")
    with pytest.raises(ConfigError, match=rf"weight_sync.sharded.*MLA.*{SHARD_DIRECT}.*use 'auto' or 'off'"):
        on.sharded_layout(WITH_LOADER)


def test_on_without_its_loader_is_refused_naming_it(tmp_path):
    on = sender(tmp_path, QWEN3_8B, "weight_sync.transport=disk", "weight_sync.sharded=on")
    with pytest.raises(ConfigError, match=rf"weight_sync.sharded.*{SHARD_LOADER}.*--custom-weight-loader"):
        on.sharded_layout(EngineSharding(tp=2))


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["weight_sync.transport=tensor", "rollout.engine.tensor_parallel=2", "rollout.engine.device=cuda",
      "rollout.engine.attention_data_parallel=2"], r"DP attention"),
], ids=["dp-attention"])
def test_on_where_the_config_alone_rules_it_out_fails_check_config(tmp_path, overrides, fragment):
    with pytest.raises(ConfigError, match=rf"weight_sync.sharded.*{fragment}"):
        sender(tmp_path, QWEN3_8B, "weight_sync.sharded=on", *overrides)


@pytest.mark.parametrize(("transport", "loaders", "slots"), [
    ("tensor", (SHARD_LOADER, SHARD_DIRECT), True), ("tensor", (SHARD_LOADER,), False),
    ("disk", (SHARD_LOADER,), True)], ids=["tensor-by-name", "tensor-stock-direct", "disk"])
def test_experts_travel_one_at_a_time_where_slimishs_loader_takes_them(tmp_path, transport, loaders, slots):
    """An MoE model's experts go into their slots one by one (`EngineShards`, `engine_loader.slot_name`) where the
    engines list slimish's loader of the transport; over tensor without `load_by_name`, SGLang's stock direct copy
    takes only whole stacked parameters."""
    layout = sender(tmp_path, QWEN3_30B_A3B, f"weight_sync.transport={transport}").sharded_layout(
        EngineSharding(tp=2, loaders=loaders))
    assert layout.expert_slots == slots
    assert layout.direct_loadable == (not slots)


def test_no_two_senders_name_a_group_alike(tmp_path):
    """Group names carry a token of the job's sender (rank 0's, shared by every rank at the first connect), so a
    restarted job's groups never take the name of a group an engine that outlived the old job still holds (the
    engine would take a request naming it for the old group, whose sender is gone, and the join would wait)."""
    from slimish.weight_sync.sender import _shared_nonce

    first, second = (sender(tmp_path, QWEN3_8B) for _ in range(2))
    for each in (first, second):
        each._nonce, each._groups_made = _shared_nonce(), 1
    assert first._group_name() != second._group_name()
    assert first._group_name(1) != second._group_name(1) and first._group_name(1).endswith("_1_stage1")
