"""The scale table's arithmetic: bytes per link over link bandwidth."""

import pytest

from slimish.weight_sync.estimate import Cluster, sync_seconds

LLAMA_405B_BF16 = 405.85e9 * 2


def test_one_sender_needs_about_16_s_for_llama_405b_at_400_gbit():
    assert sync_seconds(LLAMA_405B_BF16, transport="broadcast") == pytest.approx(16.2, abs=0.1)


def test_stage_senders_take_turns_and_spare_rank_0_the_later_stages_bytes():
    """An engine takes one update at a time, so senders taking turns need the one-link time; through rank 0 the
    later stages' 6/7 of the model reach it first."""
    one = sync_seconds(LLAMA_405B_BF16, transport="broadcast")
    assert sync_seconds(LLAMA_405B_BF16, transport="broadcast", pipeline_parallel=7) == one
    funnel = sync_seconds(LLAMA_405B_BF16, transport="broadcast", pipeline_parallel=7, stage_senders=False)
    assert funnel == pytest.approx(one * (1 + 6 / 7))


def test_disk_writes_then_reads_every_byte():
    assert sync_seconds(20e9, transport="disk", cluster=Cluster(fs_write_gbyte_s=10, fs_read_gbyte_s=5)) == 6.0
    with pytest.raises(ValueError, match="known"):
        sync_seconds(1.0, transport="carrier_pigeon")


def test_a_sharded_disk_sync_reads_a_tth_per_engine_rank():
    """Sharded, each engine rank reads only its own files (1/t of the bytes, the ranks in parallel); the writer
    still writes every byte. Broadcast is not sharded."""
    cluster = Cluster(fs_write_gbyte_s=10, fs_read_gbyte_s=5)
    assert sync_seconds(20e9, transport="disk", cluster=cluster, engine_shards=8) == pytest.approx(2.0 + 0.5)
    assert sync_seconds(LLAMA_405B_BF16, transport="broadcast", engine_shards=8) == \
        sync_seconds(LLAMA_405B_BF16, transport="broadcast")
