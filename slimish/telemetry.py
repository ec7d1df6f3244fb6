"""Per-step GPU memory and utilisation of this process's GPUs, through NVIDIA's NVML (`nvidia-ml-py`).

Without a driver (CPU machines) it says so once, at debug level (where NVML fails otherwise: a warning), and
reports nothing from then on.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


class GpuTelemetry:
    def __init__(self, name: str):
        """`name` prefixes the metrics: `<name>/gpu<i>_mem_gb`, `<name>/gpu<i>_util`."""
        self.name = name
        self.handles: list = []
        try:
            import pynvml

            pynvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            indices = [int(i) for i in visible.split(",") if i.strip().isdigit()] if visible else \
                range(pynvml.nvmlDeviceGetCount())
            self.handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in indices]
        except Exception as exc:  # no driver or library (CPU), or NVML refused: telemetry is optional
            # Worth a word only where a GPU could be measured: without the NVML library there is no driver.
            no_driver = type(exc).__name__ == "NVMLError_LibraryNotFound"
            log.log(logging.DEBUG if no_driver else logging.WARNING, "GPU telemetry off for %s: %s", name, exc)

    def sample(self) -> dict[str, float]:
        """Memory in use (GB) and utilisation (%) of each GPU now; {} without GPUs."""
        if not self.handles:
            return {}
        import pynvml

        out = {}
        for index, handle in self.handles:
            out[f"{self.name}/gpu{index}_mem_gb"] = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 1e9
            out[f"{self.name}/gpu{index}_util"] = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        return out
