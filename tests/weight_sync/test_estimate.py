"""The scale table's arithmetic: bytes per link over link bandwidth; and the CPU model the bench calibrates."""

import pytest

from slimish.weight_sync.estimate import (
    Cluster,
    Machine,
    StageBytes,
    cpu_sync_seconds,
    cpu_sync_terms,
    cpu_sync_work,
    payload,
    several_senders,
    sync_seconds,
)

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
        pytest.approx(sync_seconds(LLAMA_405B_BF16, transport="broadcast"))


def test_a_sharded_broadcast_puts_every_ranks_payload_through_the_one_senders_nic():
    """Per-rank groups from one sender: each engine rank receives 1/t, the sender's link carries all t payloads,
    the replicated tensors t times."""
    link = Cluster().nic_gbit_s / 8 * 1e9
    assert sync_seconds(18e9, transport="broadcast", engine_shards=8, replicated_bytes=2e9) == \
        pytest.approx((18e9 + 7 * 2e9) / link)


def test_experts_from_other_nodes_reach_the_stage_leader_first():
    """DeepSeek-V3's layout: EP4 with each expert over TP8, one expert-parallel rank per node: 3/4 of the experts
    cross the leader's NIC. EP4 of ETP2 fits one node of 8 GPUs (NVLink: not counted); EP16 of ETP1 spans two."""
    link = Cluster().nic_gbit_s / 8 * 1e9
    plain = sync_seconds(100e9, transport="broadcast")
    assert sync_seconds(100e9, transport="broadcast", expert_bytes=80e9, expert_parallel=4,
                        expert_tensor_parallel=8) == pytest.approx(plain + 60e9 / link)
    assert sync_seconds(100e9, transport="broadcast", expert_bytes=80e9, expert_parallel=4,
                        expert_tensor_parallel=2) == plain
    assert sync_seconds(100e9, transport="disk", expert_bytes=80e9, expert_parallel=16) == \
        pytest.approx(sync_seconds(100e9, transport="disk") + 40e9 / link)


LINK = Cluster().nic_gbit_s / 8 * 1e9  # 50 GB/s


def test_several_senders_take_the_busiest_senders_bytes_or_one_engine_ranks_whichever_is_more():
    """Every sender's bucket on the wire at once, each engine rank receiving from all of them: the sync takes
    max(busiest sender's bytes, one engine rank's shard) over one link. Seven stage leaders of 812 GB, TP8 engines:
    the busiest stage's 119 GB (not 812); over TP2 engines each rank's half (406 GB) binds instead."""
    stages = [StageBytes(dense=119e9)] + [StageBytes(dense=(812e9 - 2 * 119e9) / 5)] * 5 + [StageBytes(dense=119e9)]
    assert sync_seconds(812e9, transport="broadcast", engine_shards=8, route="stages", stages=stages) == \
        pytest.approx(119e9 / LINK)
    assert sync_seconds(812e9, transport="broadcast", engine_shards=2, route="stages", stages=stages) == \
        pytest.approx(406e9 / LINK)
    # Stages not given: the model split evenly over pipeline_parallel.
    assert sync_seconds(700e9, transport="broadcast", engine_shards=8, route="stages", pipeline_parallel=7) == \
        pytest.approx(100e9 / LINK)


def test_one_sender_routes_keep_their_figures():
    """The full route, and the sharded route without several senders (route None) or over engines of one rank,
    give what they gave before: one sender's link carries the model."""
    one = sync_seconds(LLAMA_405B_BF16, transport="broadcast")
    assert sync_seconds(LLAMA_405B_BF16, transport="broadcast", pipeline_parallel=7, route="stages") == one
    assert sync_seconds(LLAMA_405B_BF16, transport="broadcast", engine_shards=8, pipeline_parallel=7) == \
        pytest.approx(one)
    with pytest.raises(ValueError, match="known"):
        several_senders("everyone", [StageBytes(dense=1.0)])


def test_on_the_stages_route_each_stages_experts_reach_its_own_leader_first():
    """DeepSeek-V3's layout (EP4 of ETP8: one expert-parallel rank per node): each stage's leader first takes in
    3/4 of its own stage's experts over its own link, the stages in parallel (counted before it sends, as on the
    full route)."""
    stages = [StageBytes(dense=10e9, experts=300e9)] * 4
    senders = several_senders("stages", stages, expert_parallel=4, expert_tensor_parallel=8, engine_shards=16)
    assert [(s.role, s.out_bytes, s.in_bytes) for s in senders] == [("leader", 310e9, 225e9)] * 4
    assert sync_seconds(1240e9, transport="broadcast", engine_shards=16, route="stages", stages=stages,
                        expert_parallel=4, expert_tensor_parallel=8) == pytest.approx((310e9 + 225e9) / LINK)
    # EP4 of ETP2 shares the leader's node: nothing crosses its NIC first.
    assert sync_seconds(1240e9, transport="broadcast", engine_shards=16, route="stages", stages=stages,
                        expert_parallel=4, expert_tensor_parallel=2) == pytest.approx(310e9 / LINK)


def test_on_the_owned_route_every_expert_parallel_rank_sends_its_own_experts():
    """pp x ep senders: a stage's leader its parts outside the experts and its own quarter of the experts, the three
    other owners a quarter each; nothing funnelled. The leader binds (85 GB) over the engine rank (1240 / 16)."""
    stages = [StageBytes(dense=10e9, experts=300e9)] * 4
    senders = several_senders("owned", stages, expert_parallel=4, expert_tensor_parallel=8, engine_shards=16)
    assert len(senders) == 16 and sum(s.out_bytes for s in senders) == pytest.approx(1240e9)
    assert [(s.role, s.out_bytes) for s in senders[:4]] == [("leader", 85e9)] + [("owner", 75e9)] * 3
    assert all(s.in_bytes == 0 for s in senders)
    assert sync_seconds(1240e9, transport="broadcast", engine_shards=16, route="owned", stages=stages,
                        expert_parallel=4, expert_tensor_parallel=8) == pytest.approx(85e9 / LINK)


def test_several_disk_writers_write_at_once_then_each_engine_rank_reads_its_shard():
    """Each sender writes its own bytes at the write bandwidth, the senders in parallel; then each engine rank reads
    1/t at the read bandwidth; a stage's experts funnelled to its leader cross its link first."""
    cluster = Cluster(fs_write_gbyte_s=10, fs_read_gbyte_s=5)
    stages = [StageBytes(dense=30e9), StageBytes(dense=10e9)]
    assert sync_seconds(40e9, transport="disk", cluster=cluster, engine_shards=4, route="stages", stages=stages) == \
        pytest.approx(3.0 + 2.0)
    moe = [StageBytes(dense=10e9, experts=40e9)] * 2
    assert sync_seconds(100e9, transport="disk", cluster=cluster, engine_shards=4, route="stages", stages=moe,
                        expert_parallel=16, expert_tensor_parallel=1) == pytest.approx(5.0 + 20e9 / LINK + 5.0)
    assert sync_seconds(100e9, transport="disk", cluster=cluster, engine_shards=4, route="owned", stages=moe,
                        expert_parallel=4) == pytest.approx(2.0 + 5.0)


def test_the_replicated_tensors_go_t_times_from_the_leaders():
    """What every engine rank holds whole leaves each leader t times, shared in proportion to its stage's parts
    outside the experts; each engine rank receives its 1/t of the rest plus all of it."""
    stages = [StageBytes(dense=30e9), StageBytes(dense=10e9)]
    senders = several_senders("stages", stages, engine_shards=8, replicated_bytes=2e9)
    assert [s.out_bytes for s in senders] == [pytest.approx(30e9 + 7 * 1.5e9), pytest.approx(10e9 + 7 * 0.5e9)]
    assert sync_seconds(40e9, transport="broadcast", engine_shards=8, replicated_bytes=2e9, route="stages",
                        stages=stages) == pytest.approx((30e9 + 7 * 1.5e9) / LINK)


# ------------------------------------------------------------------------------------ the CPU model's arithmetic

ONE = Machine(copy_gbyte_s=1, hash_gbyte_s=1, link_gbyte_s=1, fs_write_gbyte_s=1, fs_read_gbyte_s=1)
SLOW_HASH = Machine(copy_gbyte_s=1, hash_gbyte_s=0.25, link_gbyte_s=1, fs_write_gbyte_s=1, fs_read_gbyte_s=1)


def test_full_every_rank_receives_the_model_and_keeps_its_shard_plus_the_replicated():
    load = payload(10e9, engine_tp=2, sharded=False, replicated_bytes=2e9, fused_bytes=6e9)
    assert (load.rank_bytes, load.sender_bytes, load.held_bytes, load.link_bytes) == (10e9, 10e9, 6e9, 20e9)
    assert load.assembled_bytes == 0


def test_sharded_each_rank_receives_what_it_holds_and_the_sender_stages_the_replicated_t_times():
    load = payload(10e9, engine_tp=2, sharded=True, replicated_bytes=2e9, fused_bytes=6e9)
    assert (load.rank_bytes, load.sender_bytes, load.held_bytes, load.link_bytes) == (6e9, 12e9, 6e9, 12e9)
    assert load.assembled_bytes == 6e9


def test_the_cpu_terms_per_transport():
    full = payload(4e9, engine_tp=2, sharded=False)
    assert cpu_sync_terms(full, transport="tensor", machine=ONE) == \
        {"requests": 0.0, "assemble": 0.0, "stage": 4.0, "load": 2.0, "hash": 4.0, "contiguous": 0.0, "verify": 2.0}
    assert cpu_sync_terms(full, transport="broadcast", machine=ONE)["wire"] == 8.0  # put out once per rank
    disk = cpu_sync_terms(payload(4e9, engine_tp=2, sharded=True), transport="disk", machine=ONE)
    assert (disk["stage"], disk["read"]) == (4.0, 2.0)
    with pytest.raises(ValueError, match="known"):
        cpu_sync_terms(full, transport="carrier_pigeon", machine=ONE)


def with_cores(machine: Machine, cores: float) -> Machine:
    return Machine(**{**machine.__dict__, "cores": cores})


def test_with_cores_to_spare_the_longest_chain_counts():
    """The sender's path (stage 4 + one rank's load 2) beside its hashing thread (4), then one rank's checksums."""
    full = payload(4e9, engine_tp=2, sharded=False)
    assert cpu_sync_seconds(full, transport="tensor", machine=with_cores(ONE, 8)) == max(4.0 + 2.0, 4.0) + 2.0
    assert cpu_sync_seconds(full, transport="tensor", machine=with_cores(SLOW_HASH, 8)) == 16.0 + 8.0


def test_on_few_cores_every_threads_cpu_seconds_count():
    """Stage 4 + hash 4 + two ranks' loads 2 x 2 = 12 CPU-seconds, then two ranks' checksums 2 x 2: over 1 core
    12 + 4, and over half a core (other jobs take the rest) each chain at half speed too."""
    full = payload(4e9, engine_tp=2, sharded=False)
    assert cpu_sync_work(full, transport="tensor", machine=ONE) == (12.0, 4.0)
    assert cpu_sync_seconds(full, transport="tensor", machine=with_cores(ONE, 1)) == 12.0 + 4.0
    assert cpu_sync_seconds(full, transport="tensor", machine=with_cores(ONE, 0.5)) == 24.0 + 8.0


def test_the_hashing_thread_gets_its_fair_share_beside_the_path():
    """Over 2 cores: the path (stage 4, then one rank's load 2; 8 CPU-seconds with both ranks' loads) keeps 4/3
    threads busy on average; with the hashing thread beside it, 7/3 threads share 2 cores, each at 6/7 of a CPU:
    the 4 seconds of hashes and the path's first 4 take 4 x 7/6, the path's last 2 run at full pace (4/3 threads
    on 2 cores), then the engines' checksums 2 x 2 over 2 cores. More than the CPU-seconds over the cores (6):
    the hashes do not fill the cores the path leaves idle."""
    full = payload(4e9, engine_tp=2, sharded=False)
    assert cpu_sync_seconds(full, transport="tensor", machine=with_cores(ONE, 2)) == \
        pytest.approx(4 * 7 / 6 + 2 + 2)


def test_strided_slices_are_copied_before_they_are_hashed():
    """A row-parallel weight's slice is a strided view: the hashing thread copies it into a fresh tensor
    (`fresh_gbyte_s`) before SHA-256 reads it, on its own chain and in the work."""
    machine = Machine(copy_gbyte_s=1, hash_gbyte_s=1, link_gbyte_s=1, fs_write_gbyte_s=1, fs_read_gbyte_s=1,
                      fresh_gbyte_s=0.5, cores=8)
    plain, strided = payload(4e9, engine_tp=2, sharded=False), payload(4e9, engine_tp=2, sharded=False,
                                                                         strided_bytes=2e9)
    assert cpu_sync_terms(strided, transport="tensor", machine=machine)["contiguous"] == 4.0
    assert cpu_sync_work(strided, transport="tensor", machine=machine)[0] == \
        cpu_sync_work(plain, transport="tensor", machine=machine)[0] + 4.0
    # the hashing thread's chain (4 + 4) outlasts the path (stage 4 + load 2), then one rank's checksums 2
    assert cpu_sync_seconds(strided, transport="tensor", machine=machine) == 8.0 + 2.0


def test_on_disk_the_senders_hashes_run_beside_its_writes():
    """safetensors' writer releases the GIL (measured): the hashing thread (16) runs beside the whole path (write 4,
    read 4, load 2), as on the other transports, then one rank's checksums (8)."""
    full = payload(4e9, engine_tp=2, sharded=False)
    machine = with_cores(SLOW_HASH, 8)
    assert cpu_sync_seconds(full, transport="disk", machine=machine) == 16.0 + 8.0
    assert cpu_sync_seconds(full, transport="tensor", machine=machine) == 16.0 + 8.0


def test_the_disks_writes_count_at_their_cpu_rate_in_the_work():
    """The writes' seconds (write bandwidth 1) stand in the path; their CPU-seconds (4 GB/s) in the work."""
    full = payload(4e9, engine_tp=2, sharded=False)
    machine = Machine(copy_gbyte_s=1, hash_gbyte_s=1, link_gbyte_s=1, fs_write_gbyte_s=1, fs_read_gbyte_s=1,
                      fs_write_cpu_gbyte_s=4)
    # write 1 + hash 4 + two ranks' (read 4 + load 2), then two ranks' checksums 2 x 2
    assert cpu_sync_work(full, transport="disk", machine=machine) == (17.0, 4.0)


def test_the_wire_keeps_sender_and_receivers_busy():
    """Broadcast: the raw broadcast's CPUs (`link_busy_cores`) for as long as the wire takes count as work; a fresh
    receive buffer costs each rank its pages beyond the copy."""
    full = payload(4e9, engine_tp=2, sharded=False)
    machine = Machine(copy_gbyte_s=1, hash_gbyte_s=1, link_gbyte_s=1, fs_write_gbyte_s=1, fs_read_gbyte_s=1,
                      fresh_gbyte_s=0.5, link_busy_cores=2, cores=1)
    terms = cpu_sync_terms(full, transport="broadcast", machine=machine)
    assert (terms["wire"], terms["receive"]) == (8.0, 4.0)
    # stage 4 + hash 4 + wire 8 x 2 busy + two ranks' (receive 4 + load 2): 36 CPU-seconds on one core; the
    # hashing thread beside a path that keeps 32 / 18 threads busy runs at 18 / 50 of a CPU: the 4 seconds of
    # hashes and 4 of the path's take 4 x 50 / 18, the path's other 14 at 32 / 18 its pace: 36 as well
    assert cpu_sync_seconds(full, transport="broadcast", machine=machine) == pytest.approx(36.0 + 4.0)


def test_every_request_costs_cpu_seconds_besides_its_bytes():
    """Six buckets and four more requests at 0.1 CPU-seconds each: 1 CPU-second more work over one core."""
    full = payload(4e9, engine_tp=2, sharded=False)
    one_core = with_cores(ONE, 1)
    busy = Machine(**{**one_core.__dict__, "request_cpu_s": 0.1})
    assert cpu_sync_seconds(full, transport="tensor", machine=busy, buckets=6) == \
        pytest.approx(cpu_sync_seconds(full, transport="tensor", machine=one_core, buckets=6) + 1.0)


def test_one_engine_request_per_bucket_and_four_per_sync_in_the_senders_path():
    machine = Machine(copy_gbyte_s=1, hash_gbyte_s=1, link_gbyte_s=1, fs_write_gbyte_s=1, fs_read_gbyte_s=1,
                      request_s=0.5, cores=8)
    full = payload(4e9, engine_tp=2, sharded=False)
    assert cpu_sync_terms(full, transport="tensor", machine=machine, buckets=6)["requests"] == 5.0
    assert cpu_sync_seconds(full, transport="tensor", machine=machine, buckets=6) == 5.0 + 6.0 + 2.0


def test_a_sharded_disk_sync_writes_the_replicated_tensors_once_per_rank():
    cluster = Cluster(fs_write_gbyte_s=10, fs_read_gbyte_s=5)
    # 8 ranks of (18 - 2) / 8 + 2 = 4 GB each: 32 GB written, 4 GB read per rank
    assert sync_seconds(18e9, transport="disk", cluster=cluster, engine_shards=8, replicated_bytes=2e9) == \
        pytest.approx(3.2 + 0.8)
