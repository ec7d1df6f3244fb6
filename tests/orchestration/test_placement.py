"""Engine placement slots (`slimish.orchestration.placement.reserve_engines`) on a real local Ray of one node.
Engines spanning nodes are placed for real on the Slurm tier's two nodes (tests/slurm/test_sbatch.py)."""

from __future__ import annotations

from tests.orchestration.ray_probe import run_probe


def test_engines_get_a_slot_per_node_part_and_spanning_more_nodes_than_the_cluster_has_is_one_line():
    out = run_probe("placement_probe.py")
    assert "parts=[1, 1] bundles=[0, 1]" in out, out
    assert ("error: rollout.engine.nodes_per_engine is 2, but the Ray cluster has 1 node(s): run the job on at least "
            "2 nodes (sbatch -N), or lower it") in out, out
