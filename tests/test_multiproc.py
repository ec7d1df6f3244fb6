"""The test worlds of `tests/multiproc.py` leave nothing running: what a rank starts ends with it."""

from __future__ import annotations

import textwrap

import psutil

from tests.multiproc import run_world

RANK = textwrap.dedent('''
    import multiprocessing, subprocess, sys
    from pathlib import Path

    if __name__ == "__main__":
        out = Path(sys.argv[sys.argv.index("--out") + 1])
        manager = multiprocessing.get_context("spawn").Manager()  # as Megatron's checkpoint writer does
        sleeper = subprocess.Popen(["sleep", "600"])  # a child no exit handler stops
        rank = sys.argv[sys.argv.index("--rank") + 1]
        (out / f"rank{rank}.pids").write_text(f"{manager._process.pid} {sleeper.pid}")
''')


def test_a_world_leaves_no_process_of_its_ranks_behind(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    run_world(script, world_size=2, args=["--out", str(tmp_path)], timeout=120)
    pids = [int(pid) for rank in range(2) for pid in (tmp_path / f"rank{rank}.pids").read_text().split()]
    alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running after the world: {alive}"
