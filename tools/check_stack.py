"""The installed stack is the lock's: torch, sglang, sglang-router and megatron-core at the versions
requirements/cpu-lock.txt pins, and Transformer Engine at the GPU lock's when it is installed. Run at the end of the
container build (docker/Dockerfile) and by `make venv-gpu`, where a base image or an index could have brought
another version; tests/test_pins.py runs it on this machine's venv.

Usage: python tools/check_stack.py [REPO]; prints `stack ok: ...` or one line per mismatch (and exits 1).
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

STACK = ("torch", "sglang", "sglang-router", "megatron-core")


def pins(path: Path) -> dict[str, str]:
    """name -> version of every `name==version` line of a requirements file (extras and markers dropped)."""
    found = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s;#]+)", line)
        if match:
            found[match.group(1).lower()] = match.group(3)
    return found


def mismatches(repo: Path) -> tuple[list[str], list[str]]:
    """(what differs from the locks, what matches), each as `name version` phrases."""
    wanted = {name: v for name, v in pins(repo / "requirements/cpu-lock.txt").items() if name in STACK}
    gpu = pins(repo / "requirements/gpu-lock.txt")
    bad, good = [], []
    for name, pinned in [*wanted.items(), *gpu.items()]:
        try:
            installed = version(name)
        except PackageNotFoundError:
            if name in gpu:  # Transformer Engine: only on a GPU install
                continue
            bad.append(f"{name} is not installed (the lock pins {pinned})")
            continue
        if installed.split("+")[0] == pinned:  # a local version label (torch 2.14.1+cu130): the same release
            good.append(f"{name} {installed}")
        else:
            bad.append(f"{name} {installed} is installed, the lock pins {pinned}")
    return bad, good


def main(argv: list[str]) -> int:
    repo = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1]
    bad, good = mismatches(repo)
    for line in bad:
        print(f"stack mismatch: {line}")
    if not bad:
        print("stack ok: " + ", ".join(good))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
