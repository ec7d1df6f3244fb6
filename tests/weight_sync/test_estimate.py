"""The scale table's arithmetic: bytes per link over link bandwidth."""

import pytest

from slimish.weight_sync.estimate import Cluster, sync_seconds

LLAMA_405B_BF16 = 405.85e9 * 2


def test_one_sender_needs_about_16_s_for_llama_405b_at_400_gbit():
    assert sync_seconds(LLAMA_405B_BF16, transport="broadcast") == pytest.approx(16.2, abs=0.1)


def test_stage_senders_divide_the_time():
    one = sync_seconds(LLAMA_405B_BF16, transport="broadcast")
    assert sync_seconds(LLAMA_405B_BF16, transport="broadcast", senders=7) == pytest.approx(one / 7)


def test_disk_writes_then_reads_every_byte():
    assert sync_seconds(20e9, transport="disk", cluster=Cluster(fs_write_gbyte_s=10, fs_read_gbyte_s=5)) == 6.0
    with pytest.raises(ValueError, match="known"):
        sync_seconds(1.0, transport="carrier_pigeon")
