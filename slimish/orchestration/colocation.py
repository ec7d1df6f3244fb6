"""Trainer ranks and engines taking turns on the GPUs they share (`placement.colocate`).

A colocated RL step (rl.mode sync; the engines generate while the trainer is offloaded):

  rollout -> release (the engines free their weights, KV cache and CUDA graphs: SGLang's
  /release_memory_occupation) -> onload (the trainer takes its memory back) -> train -> offload state (optimizer
  state and gradients to host memory) -> resume weights (the engines take their weights' memory back; what it holds
  is stale: released weights are not kept) -> full sync (every parameter, read from the trainer's parameters, still
  on the GPU) -> offload params -> resume kv_cache (and CUDA graphs): the engines can generate again.

So the GPU never holds the trainer's optimizer state beside the engines' weights, nor the trainer's parameters
beside the engines' KV cache. A checkpoint saved between steps: the engines release their KV cache around it while
the trainer onloads for the save (`TrainerWorker.save_checkpoint`). The job's start: the trainer builds its model and
offloads it before the engines start.

Every phase is logged as it ends (INFO, with its seconds); a step's metrics get time_release_s, time_onload_s,
time_offload_s, time_resume_s, the bytes offloaded by all ranks (offload_bytes), and, on GPUs, the memory in use on
each trainer rank's GPU at the end of each phase (`<trainer>/gpu<i>_mem_gb@<phase>`).

On the CPU the engines' release frees nothing (SGLang's memory saver is CUDA-only) and the trainer has nothing on a
device to offload: the order of the calls is the same, and that is what the CPU tests check.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from slimish.orchestration.ray_cluster import TrainerGroup, ray

logger = logging.getLogger(__name__)

ALL = ["weights", "kv_cache", "cuda_graph"]  # SGLang's memory tags (GPU_MEMORY_ALL_TYPES)
WEIGHTS = ["weights"]
GENERATION = ["kv_cache", "cuda_graph"]  # what the engines need beyond their weights to generate


class ColocatedTurns:
    """The turns of `trainer` and the engines of `rollout_manager` (a Ray actor handle) on their shared GPUs; see the
    module docstring. `on_phase(phase, step)` is called as each phase begins (the job's run.phase_hook); `gpus`: the
    trainer ranks hold GPUs, whose memory is sampled at the end of each phase (without, there is none to sample)."""

    def __init__(self, trainer: TrainerGroup, rollout_manager, on_phase: Callable[[str, int], None] | None = None,
                 *, gpus: bool = False):
        self.trainer, self.rollout_manager = trainer, rollout_manager
        self.on_phase, self.gpus = on_phase, gpus
        self.metrics: dict[str, float] = {}

    def pop_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return metrics

    @contextmanager
    def _phase(self, name: str, step: int, metric: str) -> Iterator[dict]:
        """Time phase `name` of step `step` into metric `metric` (summed), log it, and sample the GPUs' memory at
        its end."""
        if self.on_phase is not None:
            self.on_phase(name, step)
        extra: dict = {}
        t0 = time.monotonic()
        yield extra
        seconds = time.monotonic() - t0
        self.metrics[metric] = self.metrics.get(metric, 0.0) + seconds
        memory = {f"{key}@{name}": value for rank in (self.trainer.call_all("gpu_telemetry") if self.gpus else [])
                  for key, value in rank.items() if key.endswith("_mem_gb")}
        self.metrics.update(memory)
        shown = "".join(f", {key} {value:.2f} GB" for key, value in memory.items())
        logger.info("colocated step %d: %s in %.2fs%s%s", step, name, seconds, extra.get("note", ""), shown)

    def first_offload(self) -> None:
        """Before the engines start: the built trainer leaves the GPUs to them."""
        with self._phase("offload", 0, "time_offload_s") as extra:
            extra["note"] = self._offload(["params", "state"])

    def trainer_turn(self, step: int) -> None:
        """The engines (idle) release their memory, and the trainer takes its own back."""
        with self._phase("release", step, "time_release_s"):
            ray.get(self.rollout_manager.release_memory.remote(ALL))
        with self._phase("onload", step, "time_onload_s"):
            self.trainer.call_all("onload")

    def engines_turn(self, step: int, sync: Callable[[], dict]) -> dict:
        """After training: the trainer leaves the GPUs to the engines, which get the trained weights by a full
        `sync()` (whose metrics are returned) once their weights' memory is back and before their KV cache is."""
        with self._phase("offload_state", step, "time_offload_s") as extra:
            extra["note"] = self._offload(["state"])
        with self._phase("resume_weights", step, "time_resume_s"):
            ray.get(self.rollout_manager.resume_memory.remote(WEIGHTS))
        with self._phase("full_sync", step, "time_colocated_sync_s"):
            metrics = sync()
        with self._phase("offload_params", step, "time_offload_s") as extra:
            extra["note"] = self._offload(["params"])
        with self._phase("resume_kv_cache", step, "time_resume_s"):
            ray.get(self.rollout_manager.resume_memory.remote(GENERATION))
        return metrics

    @contextmanager
    def saving(self, step: int) -> Iterator[None]:
        """Around a checkpoint save between steps: the engines release their KV cache while the trainer onloads
        for the save (their weights stay: no sync is needed after)."""
        with self._phase("release_kv_cache", step, "time_release_s"):
            ray.get(self.rollout_manager.release_memory.remote(GENERATION))
        try:
            yield
        finally:
            with self._phase("resume_kv_cache", step, "time_resume_s"):
                ray.get(self.rollout_manager.resume_memory.remote(GENERATION))

    def _offload(self, parts: list[str]) -> str:
        ranks = self.trainer.call_all("offload", parts)
        moved = sum(rank["offload_bytes"] for rank in ranks)
        self.metrics["offload_bytes"] = self.metrics.get("offload_bytes", 0) + moved
        return f" ({'+'.join(parts)}: {moved / 2**20:.1f} MiB to host memory)"
