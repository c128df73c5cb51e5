"""Hardware profiles as plain data: what one accelerator computes and holds, and what the links between them carry.

A profile is what the planner needs to price a step, nothing more:
- per accelerator: peak dense FLOP/s per dtype (the vendor's datasheet), the share of it a large matrix multiply
  reaches (`matmul_efficiency`), memory (bytes) and its bandwidth (element-wise work is bound by it);
- per link kind: within a host (NVLink through NVSwitch) and across hosts (InfiniBand), the bandwidth one
  accelerator can send at in one direction and a per-message latency, and how many accelerators share a host.

Where the numbers come from (one profile per accelerator; nothing is fitted to the runs the planner is checked
against):
- peak FLOP/s, memory, memory bandwidth, NVLink: NVIDIA's datasheets. A100 SXM: 312 TFLOP/s dense bf16/fp16, HBM2e
  2,039 GB/s (80 GB) or 1,555 GB/s (40 GB), NVLink 3 600 GB/s per GPU both directions together (300 GB/s each
  way). H100 SXM: 989 TFLOP/s dense bf16, HBM3 3.35 TB/s, NVLink 4 900 GB/s (450 each way). H200: the H100's
  chip with 141 GB of HBM3e at 4.8 TB/s.
- units: bandwidths and FLOP/s are decimal (GB/s = 1e9 bytes/s). Memory sizes are not: a datasheet's "80 GB" or
  "141 GB" of HBM is JEDEC's gigabyte, 2**30 bytes (a GiB), as the totals the cards report show, each under its
  GiB figure by what the driver keeps (under 1 GiB) and far above its decimal one: an A100-SXM4-80GB reports
  85,056,798,720 bytes to CUDA (79.2 GiB; 80e9 is 74.5), an A100 40GB 42,405,855,232 (39.5 GiB; 40e9 is 37.3),
  nvidia-smi shows 81559 MiB on an H100 80GB (79.6 GiB) and 143771 MiB on an H200 (140.4 GiB; 141e9 bytes would
  be 131.3 GiB, 9 GiB fewer than it holds). `MEMORY_GB` holds each profile's datasheet figure, in that unit.
- across hosts: a DGX A100 (Megatron-LM's Selene) has 8 HDR InfiniBand ports of 200 Gb/s, one per GPU: 25 GB/s
  per GPU each way; a DGX H100 8 NDR ports of 400 Gb/s: 50 GB/s per GPU.
- matmul efficiency and memory efficiency, one pair per chip, from public measurements:
  A100: 0.737 and 0.79, measured on an A100 80 GB with CUDA 11.7 (mli/transformers-benchmarks, micro_bench:
  fp16 8192² matmul 230 of 312 TFLOP/s; an element-wise multiply of 4 M floats at 1.6 of 2.04 TB/s). That is the
  software of Megatron-LM's 2021 runs, which the planner is checked against. Current software does better: the
  largest bf16 matmul found by a shape search with CUDA 12.1 reached 267.9 TFLOP/s (0.859; "maximum achievable
  matmul FLOPS", stas00/ml-engineering, compute/accelerator/README.md); `hardware("a100-80gb",
  matmul_efficiency=0.859)` plans with that. H100 SXM: 0.801 (792.1 of 989 TFLOP/s, the same table, CUDA 12.1),
  memory 0.79 (not measured separately). The H200 has the H100's chip: its figures are used.
- latencies (2 us within a host, 5 us across): the order of one step of an NCCL ring on these links; at the
  message sizes of training they hardly count.

`planner.hardware(name)` (catalog.py) picks one; "local" is the running cluster's engines (CPU or GPU), measured
(local.py).
Write your own profile with `Hardware(...)` and `Link(...)`, or `planner.hardware("h100-sxm", gpus_per_host=4)`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nbdist.errors import DistUsageError

GiB = 2**30
HALF = ("bf16", "fp16")  # mixed precision: half-precision compute, fp32 master weights in the optimizer


@dataclass(frozen=True)
class Link:
    """One kind of link: the bandwidth one accelerator sends at in one direction (bytes/s) and a message's
    latency (s). A collective over n members costs its steps × latency + its bytes per member / bandwidth."""

    name: str
    bandwidth: float
    latency: float

    def describe(self) -> str:
        return f"{self.name}: {self.bandwidth / 1e9:.3g} GB/s per accelerator each way, {self.latency * 1e6:.3g} us"


@dataclass(frozen=True)
class Hardware:
    """An accelerator, its host and the links between accelerators (see the module docstring for the sources)."""

    name: str
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s of one accelerator
    memory_bytes: float
    memory_bandwidth: float  # bytes/s, the datasheet's
    matmul_efficiency: float  # share of peak a large matmul reaches
    intra_host: Link
    inter_host: Link
    gpus_per_host: int
    memory_efficiency: float = 0.79  # share of memory_bandwidth streaming element-wise kernels reach
    reserved_bytes: float = 1 * GiB  # what the framework keeps besides the model: CUDA context, NCCL buffers
    dtype: str = "bf16"  # the dtype a plan computes in unless it says otherwise
    notes: str = ""
    measured: dict = field(default_factory=dict, compare=False)  # for "local": what was measured, and how

    def peak(self, dtype: str | None = None) -> float:
        """Dense FLOP/s of one accelerator in `dtype` (default: the profile's)."""
        dtype = dtype or self.dtype
        if dtype not in self.peak_flops:
            raise DistUsageError(f"{self.name} has no peak FLOP/s for {dtype!r}: it lists "
                                 f"{', '.join(self.peak_flops)}")
        return self.peak_flops[dtype]

    def matmul_flops(self, dtype: str | None = None) -> float:
        """The FLOP/s a large matrix multiply reaches: peak × matmul efficiency."""
        return self.peak(dtype) * self.matmul_efficiency

    def streaming_bandwidth(self) -> float:
        """Bytes/s an element-wise kernel reaches: memory bandwidth × memory efficiency."""
        return self.memory_bandwidth * self.memory_efficiency

    @property
    def usable_memory(self) -> float:
        """Bytes a plan may use on one accelerator."""
        return self.memory_bytes - self.reserved_bytes

    def table(self) -> list[tuple[str, str]]:
        """(quantity, value) rows: every number the planner reads from this profile."""
        peaks = ", ".join(f"{k} {v / 1e12:.4g}" for k, v in self.peak_flops.items())
        return [("accelerator", self.name), ("peak dense TFLOP/s", peaks),
                ("matmul efficiency", f"{self.matmul_efficiency:.3g}"),
                ("memory", f"{self.memory_bytes / GiB:.4g} GiB ({self.reserved_bytes / GiB:.3g} GiB reserved)"),
                ("memory bandwidth", f"{self.memory_bandwidth / 1e9:.4g} GB/s × {self.memory_efficiency:.2g}"),
                ("within a host", self.intra_host.describe()), ("across hosts", self.inter_host.describe()),
                ("accelerators per host", str(self.gpus_per_host)), ("default dtype", self.dtype)]


NVLINK3 = Link("NVLink 3 (NVSwitch)", 300e9, 2e-6)
NVLINK4 = Link("NVLink 4 (NVSwitch)", 450e9, 2e-6)
HDR_IB = Link("InfiniBand HDR, 200 Gb/s per GPU", 25e9, 5e-6)
NDR_IB = Link("InfiniBand NDR, 400 Gb/s per GPU", 50e9, 5e-6)

_A100_PEAKS = {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}
_H100_PEAKS = {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494.7e12, "fp32": 66.9e12}

# Each profile's memory as its datasheet writes it, in GB of memory capacity = JEDEC's 2**30 bytes (see above).
MEMORY_GB = {"a100-80gb": 80, "a100-40gb": 40, "h100-sxm": 80, "h200": 141}

PROFILES: dict[str, Hardware] = {
    "a100-80gb": Hardware("a100-80gb", _A100_PEAKS, MEMORY_GB["a100-80gb"] * GiB, 2039e9, 0.737, NVLINK3, HDR_IB, 8,
                          notes="DGX A100 (Megatron-LM's Selene): 8 GPUs, NVSwitch, 8 x HDR 200 Gb/s"),
    "a100-40gb": Hardware("a100-40gb", _A100_PEAKS, MEMORY_GB["a100-40gb"] * GiB, 1555e9, 0.737, NVLINK3, HDR_IB, 8,
                          notes="DGX A100 40 GB"),
    "h100-sxm": Hardware("h100-sxm", _H100_PEAKS, MEMORY_GB["h100-sxm"] * GiB, 3350e9, 0.801, NVLINK4, NDR_IB, 8,
                         notes="DGX H100: 8 GPUs, NVSwitch, 8 x NDR 400 Gb/s"),
    "h200": Hardware("h200", _H100_PEAKS, MEMORY_GB["h200"] * GiB, 4800e9, 0.801, NVLINK4, NDR_IB, 8,
                     notes="HGX H200: the H100's chip, 141 GB HBM3e"),
}
