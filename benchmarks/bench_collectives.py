#!/usr/bin/env python
"""nbdist's collectives benchmark against a plain torch.distributed timing loop on the same engines, in one run.

What is measured (2 MPI engines from `nbdist.start(2)`, torch.distributed/gloo initialised by nbdist):

1. all-reduce busbw at each size (default 1 KiB, 4 KiB, ..., 64 MiB): `nbdist.collectives.benchmark(ops=
   ("all_reduce",), via=("torch",), sizes=(S,))` against a minimal hand-written script run on the engines: a
   `torch.ones` float32 buffer of S bytes, the same number of warm-up calls, `dist.barrier()`, k back-to-back
   `dist.all_reduce` calls timed with perf_counter, t = loop / k, the slowest rank's t, busbw = S / t × 2(n-1)/n.
   k is the iteration count nbdist chose for that size in an untimed first round, so both loops last as long.
   Every repetition runs every size on both sides, who goes first alternating (by size and repetition); the
   ratio nbdist busbw / plain busbw is taken per repetition, its median per size, and the median of those over
   the sizes. Target: median ratio >= 0.95 (per-size rows are shown, informative).
2. torch (gloo) against MPI (mpi4py on the same tensors' memory): all-reduce busbw and time at each size, both
   through `nbdist.collectives.benchmark(via=("torch", "mpi"))`, which alternates the two at each size; medians
   over the repetitions, beside the figures the issue quotes (2 engines: 1 KiB 1.5 ms vs 8 us, 4 MiB 3.1 ms vs
   0.64 ms, 16 MiB 11 ms vs 3.1 ms).
3. (unless --no-sweep) every op through both ways once, as nbdist shows it, and the alpha-beta fits of the
   all-reduce through each way, with the ring-vs-tree crossover they predict for 8 ranks.

Run (the mpich wheel's mpiexec beside this Python, or one on PATH):

    python benchmarks/bench_collectives.py [--sizes 1K,4K,...,64M] [--repeats 5] [--json out.json]

A run takes about 2 minutes on 2 cores. The exit status is 0 when the counted target is met, every check passed
and no process was left running. ipyparallel logs to stderr; the tables go to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys



from common import ClusterTracker, put_mpiexec_on_path  # noqa: E402 (benchmarks/ is on sys.path)

put_mpiexec_on_path()

import nbdist  # noqa: E402
from nbdist.collectives import fit_alpha_beta  # noqa: E402
from nbdist.collectives.sweep import BenchmarkResult, format_bytes  # noqa: E402
from nbdist.collectives.sweep import benchmark as nbdist_benchmark  # noqa: E402

N_ENGINES = 2
RATIO_TARGET = 0.95
DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M"
WARMUP = 5
ISSUE_QUOTES = {1024: (1.5e-3, 8e-6), 4 * 2**20: (3.1e-3, 0.64e-3), 16 * 2**20: (11e-3, 3.1e-3)}  # gloo, MPI s


# -- the plain script, run on the engines ------------------------------------------------------------------------
# ipyparallel sends a function defined in __main__ as its code; it imports what it needs inside (keep it so: a
# linter's fix moving the imports out would break it on the engines).


def _engine_plain_all_reduce(nbytes: int, k: int, warmup: int) -> float:
    """What one writes by hand: a buffer, warm-up, a barrier, k all-reduces timed; seconds per all-reduce."""
    import time

    import torch
    import torch.distributed as dist

    x = torch.ones(nbytes // 4)
    for _ in range(warmup):
        dist.all_reduce(x)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(k):
        dist.all_reduce(x)
    return (time.perf_counter() - start) / k


def plain_busbw(cluster: nbdist.Cluster, size: int, k: int) -> float:
    seconds = max(cluster.run(_engine_plain_all_reduce, size, k, WARMUP))
    n = cluster.world_size
    return size / seconds / 1e9 * 2 * (n - 1) / n


def nbdist_row(cluster: nbdist.Cluster, size: int, via=("torch",)) -> BenchmarkResult:
    return nbdist_benchmark(ops=("all_reduce",), via=via, sizes=(size,), cluster=cluster, warmup=WARMUP)


# -- process bookkeeping ------------------------------------------------------------------------------------------


Tracker = ClusterTracker


# -- 1: nbdist against the plain loop -----------------------------------------------------------------------------


def measure_against_plain(cluster: nbdist.Cluster, sizes: list[int], repeats: int, log) -> dict:
    """Per size: nbdist's and the plain loop's busbw per repetition (interleaved), and their ratios."""
    iters = {}
    for size in sizes:  # untimed round: warms both sides up and fixes the plain loop's k to nbdist's choice
        iters[size] = nbdist_row(cluster, size)[0]["iters"]
        plain_busbw(cluster, size, iters[size])
    samples = {size: {"nbdist": [], "plain": [], "nbdist_iters": []} for size in sizes}
    for rep in range(repeats):
        for i, size in enumerate(sizes):
            for side in ("nbdist", "plain") if (rep + i) % 2 == 0 else ("plain", "nbdist"):
                if side == "nbdist":
                    row = nbdist_row(cluster, size)[0]
                    samples[size]["nbdist"].append(row["busbw"])
                    samples[size]["nbdist_iters"].append(row["iters"])
                else:
                    samples[size]["plain"].append(plain_busbw(cluster, size, iters[size]))
        ratios = [samples[s]["nbdist"][-1] / samples[s]["plain"][-1] for s in sizes]
        log(f"  repetition {rep + 1}/{repeats}: nbdist/plain busbw per size "
            + " ".join(f"{r:.2f}" for r in ratios))
    for size in sizes:
        s = samples[size]
        s["plain_iters"] = iters[size]
        s["ratios"] = [a / b for a, b in zip(s["nbdist"], s["plain"])]
        s["ratio_median"] = statistics.median(s["ratios"])
    return samples


def plain_table(samples: dict) -> tuple[str, float]:
    header = ["all_reduce via torch (gloo)", "nbdist busbw (GB/s)", "plain busbw (GB/s)", "ratio", "spread",
              "target", "result"]
    rows = []
    for size, s in samples.items():
        spread = f"{min(s['ratios']):.2f}..{max(s['ratios']):.2f}"
        rows.append([format_bytes(size), f"{statistics.median(s['nbdist']):.4f}",
                     f"{statistics.median(s['plain']):.4f}", f"{s['ratio_median']:.3f}", spread,
                     f"ratio >= {RATIO_TARGET:g}", _verdict(s["ratio_median"]) + " (info)"])
    overall = statistics.median(s["ratio_median"] for s in samples.values())
    rows.append(["all sizes: median of the per-size ratios", "", "", f"{overall:.3f}", "",
                 f"ratio >= {RATIO_TARGET:g}", _verdict(overall)])
    return _format(header, rows), overall


def _verdict(ratio: float) -> str:
    return "PASS" if ratio >= RATIO_TARGET else "MISS"


# -- 2: gloo against MPI ------------------------------------------------------------------------------------------


def measure_gloo_vs_mpi(cluster: nbdist.Cluster, sizes: list[int], repeats: int, log) -> dict:
    """Per size and via: seconds and busbw per repetition (nbdist alternates the two ways at each size)."""
    out = {size: {"torch": {"seconds": [], "busbw": []}, "mpi": {"seconds": [], "busbw": []}} for size in sizes}
    for rep in range(repeats):
        for size in sizes:
            for row in nbdist_row(cluster, size, via=("torch", "mpi") if rep % 2 == 0 else ("mpi", "torch")):
                out[size][row["via"]]["seconds"].append(row["seconds"])
                out[size][row["via"]]["busbw"].append(row["busbw"])
                out[size][row["via"]]["backend"] = row["backend"]
        log(f"  repetition {rep + 1}/{repeats} done")
    return out


def gloo_vs_mpi_table(data: dict) -> str:
    header = ["all_reduce", "gloo time", "MPI time", "gloo busbw (GB/s)", "MPI busbw (GB/s)", "MPI speed-up",
              "issue quote gloo / MPI"]
    rows = []
    for size, per in data.items():
        t_gloo, t_mpi = (statistics.median(per[v]["seconds"]) for v in ("torch", "mpi"))
        quote = ISSUE_QUOTES.get(size)
        rows.append([format_bytes(size), _time(t_gloo), _time(t_mpi),
                     f"{statistics.median(per['torch']['busbw']):.4f}", f"{statistics.median(per['mpi']['busbw']):.4f}",
                     f"{t_gloo / t_mpi:.1f}x", f"{_time(quote[0])} / {_time(quote[1])}" if quote else ""])
    return _format(header, rows)


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


# -- 3: the whole sweep and the alpha-beta fits -------------------------------------------------------------------


def sweep(cluster: nbdist.Cluster, sizes: list[int]) -> BenchmarkResult:
    return nbdist_benchmark(sizes=sizes, cluster=cluster, warmup=WARMUP)


def fits_text(result: BenchmarkResult, n: int = 8) -> tuple[str, dict]:
    lines, out = [], {}
    for via in ("torch", "mpi"):
        fit = fit_alpha_beta(result, op="all_reduce", via=via)
        crossover = fit.crossover(n)
        out[via] = {"alpha_s": fit.alpha, "beta_s_per_byte": fit.beta, "bandwidth_gbps": fit.bandwidth / 1e9,
                    f"ring_beats_tree_above_bytes_n{n}": crossover}
        lines.append(f"  {fit!r}; with these as one message's cost, an {n}-rank ring all-reduce beats the binomial "
                     f"tree above {format_bytes(crossover)}")
    return "\n".join(lines), out


# -- report -------------------------------------------------------------------------------------------------------


def _format(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def environment(args, cluster_backend: str) -> dict:
    import ipyparallel
    import mpi4py
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "mpi4py": mpi4py.__version__,
            "ipyparallel": ipyparallel.__version__, "nbdist": nbdist.__version__, "cpus": os.cpu_count(),
            "machine": platform.platform(), "engines": N_ENGINES, "backend": cluster_backend,
            "repeats": args.repeats, "sizes": args.sizes}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"sizes S, comma-separated (default {DEFAULT_SIZES})")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per side (default 5)")
    p.add_argument("--no-sweep", action="store_true", help="skip the every-op sweep and the alpha-beta fits")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    try:
        args.size_list = sorted({parse_size(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        p.error(f"--sizes {args.sizes!r}: expected sizes like 1024, 4K, 16M")
    if args.repeats < 1 or not args.size_list or any(s <= 0 or s % (4 * N_ENGINES) for s in args.size_list):
        p.error(f"--repeats must be at least 1, and every size a positive multiple of {4 * N_ENGINES} bytes")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tracker = Tracker()
    results: dict = {}
    left: list[str] = []

    def log(text: str) -> None:
        print(text, flush=True)
        tracker.note_foreign(text.strip()[:60])

    try:
        log(f"{N_ENGINES} engines: starting")
        cluster = tracker.start(N_ENGINES)
        backend = cluster.status().rows[0]["backend"]
        log(f"1. nbdist vs a plain torch.distributed loop, all_reduce, {len(args.size_list)} sizes, "
            f"{args.repeats} repetitions")
        results["plain"] = measure_against_plain(cluster, args.size_list, args.repeats, log)
        log("2. gloo vs MPI, all_reduce")
        results["gloo_vs_mpi"] = measure_gloo_vs_mpi(cluster, args.size_list, args.repeats, log)
        if not args.no_sweep:
            log("3. every op through both ways, once")
            results["sweep"] = sweep(cluster, args.size_list)
        cluster.stop()
    finally:
        tracker.stop_all()
        left = tracker.leftovers()
        if left:
            print("warning: processes left running:\n  " + "\n  ".join(left), file=sys.stderr)
    table, overall = plain_table(results["plain"])
    print()
    print(table)
    print()
    print("plain loop: torch.ones buffer, warm-up, dist.barrier(), k dist.all_reduce timed, slowest rank; "
          "k = nbdist's choice: " + ", ".join(f"{format_bytes(s)} {v['plain_iters']}"
                                              for s, v in results["plain"].items()))
    print()
    print(gloo_vs_mpi_table(results["gloo_vs_mpi"]))
    fits = {}
    if "sweep" in results:
        print()
        print(results["sweep"].table())
        print()
        print("alpha-beta fits of the all-reduce sweep (relative least squares):")
        text, fits = fits_text(results["sweep"])
        print(text)
    print("leftover processes: " + ("none" if not left else "\n  " + "\n  ".join(left)))
    if tracker.foreign:
        print(f"warning: {len(tracker.foreign)} process(es) of another nbdist/ipyparallel run shared the machine "
              "during this run (figures skewed; rerun when it is quiet):")
        for line, when in list(tracker.foreign.items())[:8]:
            print(f"  {line[:100]}  (first seen at: {when})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(args, backend), "target": f"median ratio >= {RATIO_TARGET}",
                       "median_ratio": overall, "passed": overall >= RATIO_TARGET,
                       "nbdist_vs_plain": {str(k): v for k, v in results["plain"].items()},
                       "gloo_vs_mpi": {str(k): v for k, v in results["gloo_vs_mpi"].items()},
                       "sweep": results["sweep"].to_dicts() if "sweep" in results else None,
                       "alpha_beta": fits, "leftover_processes": left,
                       "foreign_processes_seen": tracker.foreign}, f, indent=2)
        print(f"results written to {args.json}")
    return 0 if overall >= RATIO_TARGET and not left else 1


if __name__ == "__main__":
    sys.exit(main())
