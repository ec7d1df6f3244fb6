"""The import rules in pyproject.toml ([tool.importlinter], run by `make lint`): the tree keeps them, and an upward
import breaks them with the offending line named."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_an_upward_import_is_caught(tmp_path):
    shutil.copytree(REPO / "slimish", tmp_path / "slimish", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    parallel = tmp_path / "slimish/trainer/parallel.py"
    upward = "\n\ndef _placement():\n    from slimish.orchestration import placement\n    return placement\n"
    parallel.write_text(parallel.read_text() + upward)
    result = _lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "Lower layers never import higher ones BROKEN" in result.stdout
    assert "slimish.trainer.parallel -> slimish.orchestration.placement" in result.stdout, result.stdout[-3000:]
