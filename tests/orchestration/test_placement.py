"""Engine placement slots (`slimish.orchestration.placement.reserve_engines`) on a real local Ray of one node.
Engines spanning nodes are placed for real on the Slurm tier's two nodes (tests/slurm/test_sbatch.py)."""

from __future__ import annotations

import shutil
import tempfile

from slimish.orchestration.placement import trainer_group_size
from tests.orchestration.ray_probe import run_probe


def test_trainer_groups_keep_expert_tensor_groups_whole():
    """An expert-tensor-parallel group (parallel.expert_tensor_parallel) shares a node as a tensor-parallel group
    does, and the block holding whole ETP x EP groups too where a node has the GPUs for it."""
    assert trainer_group_size(tensor_parallel=1, expert_parallel=1, expert_tensor_parallel=2, node_gpus=8) == 2
    assert trainer_group_size(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1, node_gpus=8) == 2
    assert trainer_group_size(tensor_parallel=2, expert_parallel=4, expert_tensor_parallel=1, node_gpus=8) == 4
    assert trainer_group_size(tensor_parallel=2, expert_parallel=4, expert_tensor_parallel=4, node_gpus=8) == 4
    assert trainer_group_size(tensor_parallel=2, expert_parallel=2, node_gpus=0) == 4  # ETP = TP, as before


def test_engines_get_a_slot_per_node_part_and_spanning_more_nodes_than_the_cluster_has_is_one_line():
    out = run_probe("placement_probe.py")
    assert "parts=[1, 1] bundles=[0, 1]" in out, out
    assert ("error: rollout.engine.nodes_per_engine is 2, but the Ray cluster has 1 node(s): run the job on at least "
            "2 nodes (sbatch -N), or lower it") in out, out


def test_trainer_groups_stay_inside_a_node_of_a_two_node_cluster():
    """A simulated two-node Ray cluster of 3 GPUs per node (two_node_placement_probe.py): 4 trainer ranks at TP2
    reserved as single-GPU bundles (the old way) fill one node and put the last rank on the other, so the
    tensor-parallel group {2, 3} would cross nodes; reserved a group at a time, each group is on one node. A group
    larger than a node is refused in one line, and so is a colocated job with expert parallelism whose tensor
    transport would have to reach another node's engines by CUDA IPC (disk is left alone)."""
    # Its cluster is started as `ray start` starts one, which records its address where any later `ray.init()` on
    # this host looks first (RAY_TMPDIR/ray/ray_current_cluster): a Ray temp folder of its own, so that another
    # test's local Ray, started meanwhile by the other pytest-xdist worker, does not join it.
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        out = run_probe("two_node_placement_probe.py", env={"RAY_TMPDIR": temp})
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert "one-gpu-bundles per node [1, 3] groups crossing nodes 1" in out, out
    assert "grouped ['n0', 'n0', 'n1', 'n1'] bundles=[0, 1, 0, 1] groups=2 groups crossing nodes 0" in out, out
    assert ("too-large parallel.tensor_parallel (x expert_parallel) puts 4 trainer ranks in a group that must share "
            "a node, but the Ray cluster's largest node has 3 GPUs: lower it, or use nodes with more GPUs") in out, out
    assert ("colocated-ep placement.colocate with parallel.expert_parallel=2 and weight_sync.transport=tensor needs "
            "every GPU on one node") in out and "on 2 nodes: use weight_sync.transport=disk" in out, out
    assert "colocated-ep-disk None" in out and "ep-block 2 2" in out, out
