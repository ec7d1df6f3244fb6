"""Static guards of the trainer's device discipline (run by `make lint`; `tests/test_device_discipline.py` too).

1. Every tensor factory called in slimish/trainer/, slimish/weight_sync/ and slimish/collectives.py names its device
   (`device=...`: the device of the tensor it goes with, or "cpu" for data deliberately in host memory); `*_like`
   and `tensor.new_*` take their input's device and need none.
2. No tensor collective (all_reduce, broadcast, all_gather, send, recv, ...) is called outside slimish/collectives.py
   in those packages and slimish/megatron_bridge/: that module puts each tensor on its group's device. (Object
   collectives and barriers carry no tensors of ours and are not checked.)

Usage: python tools/check_devices.py [ROOT]; prints one line per violation (path:line: what) and exits 1 if any.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "rand", "randn", "randint", "linspace",
             "eye", "empty_strided", "tril_indices", "triu_indices"}
COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
               "gather", "scatter", "batch_isend_irecv"}
FACTORY_SCOPE = ("slimish/trainer", "slimish/weight_sync", "slimish/collectives.py")
COLLECTIVE_SCOPE = ("slimish/trainer", "slimish/weight_sync", "slimish/megatron_bridge")
HELPER = "slimish/collectives.py"


def _files(root: Path, scope: tuple[str, ...]) -> list[Path]:
    out = []
    for entry in scope:
        path = root / entry
        out += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return out


def _called(node: ast.Call) -> tuple[str, str] | None:
    """(module alias, function) of a call `alias.function(...)` or `torch.distributed.function(...)`."""
    func = node.func
    if not isinstance(func, ast.Attribute):
        return None
    value = func.value
    if isinstance(value, ast.Name):
        return value.id, func.attr
    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name):
        return f"{value.value.id}.{value.attr}", func.attr
    return None


def violations(root: Path) -> list[str]:
    found = []
    for path in _files(root, FACTORY_SCOPE):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            called = _called(node) if isinstance(node, ast.Call) else None
            if called and called[0] == "torch" and called[1] in FACTORIES:
                if not any(keyword.arg == "device" for keyword in node.keywords):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: torch.{called[1]}(...) names no device")
    for path in _files(root, COLLECTIVE_SCOPE):
        if path == root / HELPER:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            called = _called(node) if isinstance(node, ast.Call) else None
            if called and called[0] in ("dist", "torch.distributed") and called[1] in COLLECTIVES:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {called[0]}.{called[1]} outside {HELPER}")
    return found


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    found = violations(root)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
