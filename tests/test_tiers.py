"""The test tiers follow the folders (tests/conftest.py's `pytest_collection_modifyitems`): no test of tests/e2e or
tests/slurm is in the fast tier (`-m "not e2e and not slurm"`, what `make test-fast` runs), and each carries its
tier's marker (what `make test`'s second run selects), though no file there marks itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, TIER_BY_FOLDER


def _collected(*args: str) -> list[str]:
    """The node ids `pytest --collect-only` selects with `args` (none: exit status 5, "no tests collected")."""
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode in (0, 5), result.stdout[-3000:] + result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if "::" in line]


@pytest.mark.parametrize("folder", sorted(TIER_BY_FOLDER))
def test_a_tier_folder_is_marked_by_its_folder(folder):
    every = _collected(f"tests/{folder}")
    assert every, f"tests/{folder} holds no test"
    assert _collected("-m", "not e2e and not slurm", f"tests/{folder}") == []
    assert _collected("-m", TIER_BY_FOLDER[folder], f"tests/{folder}") == every
