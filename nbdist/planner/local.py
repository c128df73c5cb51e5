"""The "local" hardware profile: the running cluster's engines (CPU or GPU), measured rather than read from a
datasheet.

What a user expects from `planner.hardware("local")`: the planner pointed at the engines they can start here, so
its predictions can be set beside a measured step. So:
- `hardware("local", cluster=c)` measures now, on the running cluster `c` (every engine busy at once, as in a
  step), in core seconds scaled by the share of a core each engine gets now (other work on the host counted:
  sharding/core_shares.py; the notes say the share and load assumed): a matmul probe (a Linear layer's forward and backward on every engine: its FLOP/s is the profile's
  "peak", with matmul efficiency 1), a streaming probe (a ReLU's forward and backward: bytes per second, memory
  efficiency 1), and the α-β fit of a 2-rank all-reduce through torch.distributed
  (nbdist.collectives.benchmark(...).fit(), costmodel.fit_alpha_beta): the link between engines. A few seconds.
  The probes run on each engine's own device (sharding/ranks/timing.py: CUDA events on a GPU), so on GPU engines
  the profile is the GPU's: fp32 and bf16 matmul FLOP/s, its memory bandwidth, and its memory (the device's total,
  not the host's RAM). With one engine there is no link to measure: the profile says so and prices none.
- `hardware("local")` without a cluster returns STORED: the same measurements taken once on a 2-core machine with
  2 CPU engines with `hardware("local", cluster=nbdist.start(2))`, kept so the planner can be shown without
  starting engines. Another machine should measure its own.

One "accelerator" is one engine; all engines are on one host (gpus_per_host = the cluster's size), so every
group's link is the measured one. Its memory is the host's RAM shared by the engines. The dtype is fp32: CPU
engines train in fp32, so the model states take 4 + 4 + 8 bytes per parameter (memory.py).

The probe's functions run on the engines by reference (nbdist.sharding.ranks.timing.time_layers, which times a
layer's forward and backward where it runs); torch is imported here only when measuring.
"""
from __future__ import annotations

import os

from nbdist.cost.hardware import GiB, Hardware, Link

PROBE_FEATURES = 512  # the matmul probe: (tokens × 512) @ (512 × 512), forward and backward
PROBE_TOKENS = 2048
GPU_PROBE_FEATURES = 4096  # on a GPU: (8192 × 4096) @ (4096 × 4096), large enough to keep it busy
GPU_PROBE_TOKENS = 8192
STREAM_ELEMENTS = 2**22  # the streaming probe: ReLU over 4 M floats (16 MiB)
GPU_STREAM_ELEMENTS = 2**27  # on a GPU: 512 MiB, well past its caches
ALLREDUCE_SIZES = tuple(4**k for k in range(6, 13))  # 4 KiB ... 16 MiB

# hardware("local", cluster=nbdist.start(2)) on a 2-core machine (2 engines, MPICH shared memory) with other work
# running beside it; the figures move with that load (figures: benchmarks/README.md).
STORED = {"matmul_flops": 1.325e11, "stream_bandwidth": 6.65e9, "alpha": 6.19e-6, "bandwidth": 5.15e9, "engines": 2}


def stored() -> Hardware:
    """The profile from the measurements kept in STORED (see the module docstring)."""
    return _profile(STORED, "stored in nbdist/planner/local.py")


def measure(cluster) -> Hardware:
    """Measure the profile on `cluster`'s engines now (see the module docstring)."""
    from nbdist import collectives

    from nbdist.measured import machine_load
    from nbdist.sharding import core_shares

    gpus = all(device.startswith("cuda") for device in cluster.devices)
    shares = [core_shares.share_now(cluster)]
    measured = {"matmul_flops": _matmul_flops(cluster, gpus)}
    shares.append(core_shares.share_now(cluster))
    measured.update(stream_bandwidth=_stream_bandwidth(cluster, gpus), engines=cluster.world_size)
    cores = core_shares.measured(cluster, [*shares, core_shares.share_now(cluster)])
    if cores is not None:  # the probes' core seconds, at the share of a core each engine gets now
        measured.update(matmul_flops=measured["matmul_flops"] * cores.share,
                        stream_bandwidth=measured["stream_bandwidth"] * cores.share,
                        core_share=cores.share, load=machine_load().average, cores=cores.load.cores)
    if gpus:
        from nbdist.runtime.ranks.placement import memory_report

        measured["bf16_matmul_flops"] = _matmul_flops(cluster, gpus, "bf16")
        measured["device_memory"] = min(r["total"] for r in cluster.run(memory_report))
    if cluster.world_size >= 2:
        fit = collectives.benchmark(ops="all_reduce", via="torch", sizes=list(ALLREDUCE_SIZES), cluster=cluster,
                                    ranks=2).fit("all_reduce", "torch")
        # a 2-rank ring all-reduce is 2 messages of S/2: 2α + S·β, so one message costs α/2 and the link's
        # bandwidth (S/2 per message in half the time) is 1/β
        measured.update(alpha=fit.alpha / 2, bandwidth=1 / fit.beta)
    kind = "GPU" if gpus else "CPU"
    return _profile(measured, f"measured on {cluster.world_size} {kind} engine(s)")


def _profile(m: dict, how: str) -> Hardware:
    engines = int(m["engines"])
    if "bandwidth" in m:
        link = Link("engines on this host (measured all-reduce)", m["bandwidth"], m["alpha"])
    else:
        link = Link("none: one engine, nothing between engines to measure", float("inf"), 0.0)
    flops = {"fp32": m["matmul_flops"]}
    if "bf16_matmul_flops" in m:
        flops["bf16"] = m["bf16_matmul_flops"]
    memory = m.get("device_memory") or _ram_bytes() / engines
    if "core_share" in m:
        how += (f"; assumes each engine gets {m['core_share']:.2f} of a core with every engine busy, as measured "
                f"under load {m['load']:.1f} on {m['cores']} cores")
    return Hardware("local", flops, memory, m["stream_bandwidth"], 1.0, link, link,
                    engines, memory_efficiency=1.0, reserved_bytes=0.5 * GiB, dtype="fp32",
                    notes=f"this machine's engines, {how}", measured=dict(m))


def _ram_bytes() -> float:
    """The host's physical memory."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _slowest(cluster, layer, rows: int, features: int, dtype) -> float:
    """Seconds per row for forward + backward of `layer` on a (rows × features) input made on each engine's device
    (not sent from here: a GPU probe's input is hundreds of MiB), every engine at once: the slowest."""
    from nbdist.sharding.ranks.timing import time_probe

    times = cluster.run(time_probe, layer, rows, features, dtype, 5)
    return max(forward + backward for forward, backward in times)


def _matmul_flops(cluster, gpus: bool, dtype: str = "fp32") -> float:
    """FLOP/s of a Linear's forward (2·k·n per row) and backward (4·k·n per row) in `dtype`; on GPU engines the
    probe is made larger (a small one measures kernel launches, not the GPU)."""
    import torch
    from torch import nn

    k, tokens = (GPU_PROBE_FEATURES, GPU_PROBE_TOKENS) if gpus else (PROBE_FEATURES, PROBE_TOKENS)
    kind = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    seconds_per_row = _slowest(cluster, nn.Linear(k, k, bias=False), tokens, k, kind)
    return 6 * k * k / seconds_per_row


def _stream_bandwidth(cluster, gpus: bool) -> float:
    """Bytes/s of a ReLU: forward reads and writes each float (8 bytes), backward reads the gradient and the
    input and writes the input's gradient (12 bytes); on GPU engines over more memory than their caches."""
    import torch
    from torch import nn

    rows, elements = 64, GPU_STREAM_ELEMENTS if gpus else STREAM_ELEMENTS
    seconds_per_row = _slowest(cluster, nn.ReLU(), rows, elements // rows, torch.float32)
    return 20 * (elements // rows) / seconds_per_row
