"""`WeightSync`'s verification logic over stand-in engines (tests/kit/engines.py's `StandInClient`: what /model_info
and /weights_checker answer): against the sender's predicted checksums, and, for layouts it cannot predict, every
engine's tensor-parallel rank against the same rank of engine 0. Real engines: tests/e2e/test_weight_sync_engines.py."""

from __future__ import annotations

import pytest

from slimish.weight_sync.sender import sync_to
from slimish.weight_sync.sync import WeightSync, WeightSyncError
from tests.kit.engines import StandInClient, clients_by_url


def weight_sync(tmp_path, engines) -> WeightSync:
    sync = sync_to([e.url for e in engines], transport="disk", group_name="g", bucket_bytes=1 << 20, engine_tp=2,
                   disk_dir=str(tmp_path), new_client=clients_by_url(engines))
    sync.connect()
    return sync


def test_tensor_parallel_ranks_are_compared_with_the_same_rank_of_engine_0(tmp_path):
    rank0, rank1 = {"a": "1", "b": "2"}, {"a": "3", "b": "4"}
    same = [StandInClient(f"http://e{i}", "7", [dict(rank0), dict(rank1)]) for i in range(3)]
    weight_sync(tmp_path, same).check_engines("7", None)  # ranks differ from each other, not across engines
    odd = same[:2] + [StandInClient("http://e2", "7", [dict(rank0), {"a": "3", "b": "x"}])]
    with pytest.raises(WeightSyncError, match=r"engine http://e2 \(tensor-parallel rank 1\) holds other values than "
                                              r"engine 0 holds in 1 parameter\(s\): b$"):
        weight_sync(tmp_path, odd).check_engines("7", None)


def test_each_tensor_parallel_rank_is_compared_with_the_senders_prediction_for_it(tmp_path):
    expected = [{"a": "1"}, {"a": "2"}]
    engines = [StandInClient(f"http://e{i}", "7", [{"a": "1"}, {"a": "2"}]) for i in range(2)]
    weight_sync(tmp_path, engines).check_engines("7", expected)
    engines[1].ranks[1]["a"] = "1"  # rank 1 holds rank 0's shard
    with pytest.raises(WeightSyncError, match=r"engine http://e1 \(tensor-parallel rank 1\) holds other values than "
                                              r"the trainer sent in 1 parameter\(s\): a$"):
        weight_sync(tmp_path, engines).check_engines("7", expected)


def test_engines_are_compared_with_the_sender_and_the_version(tmp_path):
    engines = [StandInClient("http://e0", "7", [{"a": "1"}]), StandInClient("http://e1", "7", [{"a": "2"}])]
    with pytest.raises(WeightSyncError, match=r"http://e0 .* than the trainer sent in 1 parameter\(s\): a$"):
        weight_sync(tmp_path, engines).check_engines("7", [{"a": "9"}])
    engines[1].version = "6"
    with pytest.raises(WeightSyncError, match=r"engines report \{'http://e1': '6'\}"):
        weight_sync(tmp_path, engines).check_engines("7", None)
