"""The import rules in pyproject.toml ([tool.importlinter], run by `make lint`): the tree keeps them, and an upward
import, HTTP spoken outside slimish.engines, a slimish import in a leaf module, an import between weight sync and
rollout, or the trainer or the driver importing slimish.engines directly breaks them with the offending import
named."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_the_import_rules():
    result = _lint_imports(REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, line, broken, chain", [
    ("slimish/trainer/parallel.py", "from slimish.orchestration import placement",
     "Lower layers never import higher ones BROKEN", "slimish.trainer.parallel -> slimish.orchestration.placement"),
    ("slimish/rollout/scheduler.py", "import httpx",
     "Only slimish.engines speaks HTTP to an engine or the router", "slimish.rollout.scheduler -> httpx"),
    ("slimish/sample.py", "from slimish import errors",
     "slimish.log and slimish.sample are leaves BROKEN", "slimish.sample -> slimish.errors"),
    ("slimish/weight_sync/buckets.py", "from slimish.rollout import scheduler",
     "Weight sync and rollout are independent BROKEN", "slimish.weight_sync.buckets -> slimish.rollout.scheduler"),
    ("slimish/trainer/parallel.py", "from slimish.engines import client",
     "The trainer never imports slimish.engines directly BROKEN", "slimish.trainer.parallel -> slimish.engines.client"),
    ("slimish/orchestration/placement.py", "from slimish.engines import timeouts",
     "The job driver never imports slimish.engines directly BROKEN",
     "slimish.orchestration.placement -> slimish.engines.timeouts"),
])
def test_a_broken_rule_is_caught(tmp_path, module, line, broken, chain):
    shutil.copytree(REPO / "slimish", tmp_path / "slimish", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    path = tmp_path / module
    path.write_text(path.read_text() + f"\n\ndef _added():\n    {line}\n")
    result = _lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout[-3000:]
    assert broken in result.stdout and chain in result.stdout, result.stdout[-3000:]
