"""Engine placement slots (`slimish.orchestration.placement.reserve_engines`) on a real local Ray of one node.
Engines spanning nodes are placed for real on the Slurm tier's two nodes (tests/slurm/test_sbatch.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_engines_get_a_slot_per_node_part_and_spanning_more_nodes_than_the_cluster_has_is_one_line():
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("placement_probe.py"))], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "parts=[1, 1] bundles=[0, 1]" in result.stdout, result.stdout
    assert ("error: rollout.engine.nodes_per_engine is 2, but the Ray cluster has 1 node(s): run the job on at least "
            "2 nodes (sbatch -N), or lower it") in result.stdout, result.stdout
