"""Where a trainer rank's models start: the HF checkpoint at `model.hf_path` (the default) or a Megatron-Core
torch_dist checkpoint at `model.megatron_path` (what `slimish convert hf-to-megatron` writes, or a run's
`checkpoints/step_<N>/trainer`), read once per rank for every role, with what the read cost.

- HF: each rank reads only its slice (`bridge.load_hf_weights`, `slice_read`).
- torch_dist: Megatron's `dist_checkpointing.load` of each model chunk's sharded state dict, which reshards from
  whatever layout the checkpoint was written at (the converter writes full tensors; a trainer checkpoint the
  shards of its layout). The checkpoint is first checked against the model (`check_megatron_checkpoint`): a
  checkpoint of another model is refused in one line.
- The second and later roles built alike (the reference model, PPO's critic before its value head) copy the first
  role's freshly loaded weights instead of reading again (`bridge.copy_weights`).

Costs are measured three ways (see docs/cpu-notes.md, "Bytes read at start-up"): the bytes the HF reader asked of
the files (exact, this read only), and the process's /proc/self/io `rchar` (bytes returned by read system calls,
page cache or not; anything else the process reads meanwhile counts too) and `read_bytes` (bytes fetched from the
storage device: 0 when the page cache held the file).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from slimish.megatron_bridge import bridge, dense
from slimish.megatron_bridge.dist_ckpt_io import DistCheckpoint
from slimish.megatron_bridge.errors import CheckpointError
from slimish.megatron_bridge.hf_config import Architecture
from slimish.megatron_bridge.hf_io import HFCheckpoint

logger = logging.getLogger(__name__)


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters ({} where the kernel does not provide them)."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {}
    return {key: int(value) for key, value in (line.split(": ") for line in text.splitlines() if ": " in line)}


@dataclass
class WeightRead:
    """One role's start: `source` "hf", "megatron" or "shared" (copied from the first role); `requested`: bytes the
    HF reader asked for (None for a torch_dist read, whose reads are Megatron's); `rchar` / `read_bytes`: the
    process's /proc/self/io deltas over the load (None without /proc); `fallbacks`: parameters read whole."""
    source: str
    seconds: float
    requested: int | None = None
    rchar: int | None = None
    read_bytes: int | None = None
    fallbacks: int = 0


def check_megatron_checkpoint(path: str | Path, arch: Architecture, hf_path: str | Path) -> None:
    """Raise `CheckpointError` (one line) unless `path` is a torch_dist checkpoint holding every weight of the model
    of `hf_path` (config.json and safetensors headers) with its global shape."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: give the directory `slimish convert hf-to-megatron` wrote")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file: give the directory `slimish convert hf-to-megatron` wrote")
    ckpt = DistCheckpoint(path)
    hf = HFCheckpoint(hf_path)
    keys = set(ckpt.keys())
    for rule in dense.model_rules(arch):
        key, layer, count = dense.checkpoint_key(rule.megatron, arch)
        full = dense.megatron_shape(rule, [hf.shape(name) for name in rule.hf])
        expected = (count, *full) if layer is not None else full
        if key not in keys:
            raise CheckpointError(f"{path} has no tensor {key}: it holds another model than {hf_path}; convert that "
                                  f"model (slimish convert hf-to-megatron --hf {hf_path})")
        found = tuple(ckpt.meta(key).shape)
        if found != expected:
            raise CheckpointError(f"{path} holds another model than {hf_path}: {key} is {found} there, {expected} "
                                  f"for this model; convert that model (slimish convert hf-to-megatron --hf {hf_path})")


def load_megatron_checkpoint(chunks: list, path: str | Path) -> None:
    """Fill this rank's model `chunks` from the torch_dist checkpoint at `path` (every rank calls it: Megatron's
    loader exchanges the read plan over the default process group)."""
    from megatron.core import dist_checkpointing

    for chunk in chunks:
        sharded = chunk.sharded_state_dict()
        state = dist_checkpointing.load(sharded, str(path))
        # A run's trainer checkpoint also gives back its common (non-tensor) state, the optimizer's param groups:
        # keep the model's entries only.
        chunk.load_state_dict({key: value for key, value in state.items() if key in sharded})


class InitialWeights:
    """The starting weights of a rank's roles: `load(chunks)` fills a role's model chunks, reading the checkpoint
    for the first role and copying that role's weights into the later ones. `reads` records each load."""

    def __init__(self, arch: Architecture, *, hf_path: str, megatron_path: str = ""):
        self.arch = arch
        self.hf_path = hf_path
        self.megatron_path = megatron_path
        self.reads: list[WeightRead] = []
        self._first: list | None = None
        if megatron_path:  # before anything is built: a wrong checkpoint fails every rank at once, in one line
            check_megatron_checkpoint(megatron_path, arch, hf_path)

    @property
    def source(self) -> str:
        return self.megatron_path or self.hf_path

    def load(self, chunks: list) -> None:
        start, io_before = time.perf_counter(), proc_io()
        requested, fallbacks = None, 0
        if self._first is not None and bridge.copy_weights(self._first, chunks):
            source = "shared"
        elif self.megatron_path:
            source = "megatron"
            load_megatron_checkpoint(chunks, self.megatron_path)
        else:
            source = "hf"
            ckpt = HFCheckpoint(self.hf_path)
            fallbacks = bridge.load_hf_weights(chunks, ckpt, self.arch)
            requested = ckpt.bytes_read
        io_after = proc_io()
        delta = {key: io_after[key] - io_before[key] for key in ("rchar", "read_bytes") if key in io_after}
        self.reads.append(WeightRead(source=source, seconds=time.perf_counter() - start, requested=requested,
                                     rchar=delta.get("rchar"), read_bytes=delta.get("read_bytes"),
                                     fallbacks=fallbacks))
        if self._first is None:
            self._first = chunks

    def report(self) -> dict:
        """{"source", "roles": [each load's record], and totals: "requested", "rchar", "read_bytes", "seconds"}."""
        roles = [asdict(read) for read in self.reads]
        totals = {key: sum(r[key] or 0 for r in roles) for key in ("requested", "rchar", "read_bytes", "seconds")}
        return {"source": self.source, "roles": roles, **totals}

    def summary(self) -> str:
        """One line for the start-up log."""
        report = self.report()
        roles = ", ".join(f"{r['source']} {r['seconds']:.2f} s" for r in report["roles"])
        requested = "" if self.megatron_path else f"{_size(report['requested'])} requested, "
        return (f"initial weights from {self.source}: {requested}rchar {_size(report['rchar'])}, read_bytes "
                f"{_size(report['read_bytes'])} (0 from the page cache) in {report['seconds']:.2f} s ({roles})")


def _size(nbytes: float) -> str:
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "GiB":
            break
    return f"{nbytes:.1f} {unit}"
