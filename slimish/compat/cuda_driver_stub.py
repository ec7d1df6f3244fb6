"""A one-symbol stand-in for the NVIDIA driver library `libcuda.so.1`, used only where no driver exists.

Why: the stock CUDA wheels of `sgl_kernel` (imported unconditionally by the SGLang server) and `flash_mla`
(probed by Megatron-Core) are linked against `libcuda.so.1`, which only an NVIDIA driver installs. On a CPU-only
machine their import fails with OSError, which takes down the SGLang server and `import megatron.core`. The only
driver symbol they bind at load time is `cuPointerGetAttribute`; a tiny library exporting it (always answering
CUDA_ERROR_NO_DEVICE) lets both import, after which SGLang and Megatron-Core run their pure-torch CPU paths.
`torch.cuda.is_available()` stays False. On a machine with a real driver nothing here is used.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from pathlib import Path

_SOURCE = "int cuPointerGetAttribute(void *d, int a, unsigned long long p) { return 100; }\n"


def real_driver_library() -> ctypes.CDLL | None:
    """The real NVIDIA driver library, or None when none loads. Once this process has loaded the stub (it carries the
    same soname), dlopen("libcuda.so.1") returns the stub: a real driver is told apart by exporting cuInit."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return lib if hasattr(lib, "cuInit") else None


def real_driver_present() -> bool:
    return real_driver_library() is not None


def stub_path() -> Path:
    """Build (once, atomically) and return the stub library; needs a C compiler."""
    cache = Path(os.environ.get("SLIMISH_CACHE_DIR", Path.home() / ".cache" / "slimish"))
    target = cache / "cuda_driver_stub" / "libcuda.so.1"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "stub.c"
        src.write_text(_SOURCE)
        out = Path(tmp) / "libcuda.so.1"
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", "-o", str(out), str(src)],
                       check=True)
        os.replace(out, target)
    return target


def preload_if_needed() -> Path | None:
    """Load the stub into this process (RTLD_GLOBAL) unless a real driver loads; return its path if used."""
    if real_driver_present():
        return None
    path = stub_path()
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return path
