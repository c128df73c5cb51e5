"""What a rank tells the notebook while it trains (runs ON the engines): utilisation and memory, and its newest
step records, published through ipyparallel's datapub (the notebook reads them from the running task).

CPU engines: this process's CPU utilisation (percent of one core, psutil) and resident memory. GPU engines: the
GPU's utilisation and memory in use from NVML (nvidia-ml-py), as nvidia-smi shows them (utilisation None where NVML
cannot say, as for a MIG instance). Sampled only when publishing (at most every PUBLISH_SECONDS), so a fast loop
pays almost nothing for it.
"""
from __future__ import annotations

import time

import psutil
import torch


MIN_CPU_INTERVAL = 0.25  # seconds: psutil's CPU share over a shorter interval reads 0 or noise, and a stop's forced
# publication can come right after a periodic one (after a stop the dashboard drew no bars, on a -1..1 "%" axis)


class Sampler:
    def __init__(self, device: torch.device):
        self.process = psutil.Process()
        self.process.cpu_percent(None)  # the first call only starts the interval
        self.cpu_since, self.cpu_percent = time.monotonic(), None
        self.nvml = _nvml_handle(device) if device.type == "cuda" else None

    def sample(self) -> dict:
        out = {"cpu_percent": self._cpu_percent(), "rss_bytes": self.process.memory_info().rss}
        if self.nvml is not None:
            out.update(gpu_figures(self.nvml))
        return out

    def _cpu_percent(self) -> float | None:
        """The process's CPU share since the last sample; within MIN_CPU_INTERVAL of it, that sample's share."""
        now = time.monotonic()
        if self.cpu_percent is None or now - self.cpu_since >= MIN_CPU_INTERVAL:
            self.cpu_since, self.cpu_percent = now, self.process.cpu_percent(None)
        return self.cpu_percent


def gpu_figures(handle) -> dict:
    """The GPU's utilisation (percent) and memory in use (bytes). Utilisation is None where NVML cannot say: a MIG
    instance, and some drivers, raise NVMLError_NotSupported for it. None, not 0 (which would read as an idle
    GPU), and not a crash of the training loop that publishes it; the memory figure is kept."""
    import pynvml

    return {"gpu_percent": _utilisation(pynvml, handle),
            "gpu_memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)}


def _utilisation(pynvml, handle) -> float | None:
    try:
        return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except pynvml.NVMLError:  # NotSupported (MIG, some drivers) or any other refusal: not known
        return None


def _nvml_handle(device: torch.device):
    """NVML's handle of the rank's GPU, found as boot.py finds it (devices.nvml_device: CUDA's index is NVML's only
    where CUDA_VISIBLE_DEVICES is unset), or None."""
    try:
        import pynvml

        from nbdist.cluster.launching.ranks.boot import nvml_handle

        pynvml.nvmlInit()
        return nvml_handle(pynvml, device.index if device.index is not None else torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - no NVML (a driver without it): the dashboard shows CPU figures only
        return None


RECENT_SECONDS = 3.0  # each publication carries the records of this many seconds: the notebook, reading about twice a
# second, sees every step in some publication even when it reads late; fewer bytes than all of them every time


class Publisher:
    """Calls datapub.publish_data at most every `every` seconds (never when `every` is None: no live view)."""

    def __init__(self, trainer, every: float | None, records: int = 256):
        self.trainer, self.every, self.records = trainer, every, records
        self.last = 0.0

    def __call__(self, force: bool) -> None:
        if self.every is None:
            return
        now = time.monotonic()
        if not force and now - self.last < self.every:
            return
        self.last = now
        from ipyparallel.datapub import publish_data

        trainer = self.trainer
        since = time.perf_counter() - RECENT_SECONDS  # the notebook reads the newest publication only: overlap them
        recent = [r for r in trainer.records[-self.records:] if r["started"] >= since or r["loss"] is None]
        publish_data({"trainer": trainer.spec.name, "rank": trainer.rank, "step": trainer.step,
                      "records": recent, "pipeline_step": trainer.runner.last_step,
                      **trainer.telemetry.sample()})
