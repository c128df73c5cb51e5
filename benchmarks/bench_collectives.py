#!/usr/bin/env python
"""Does nbdist's collectives benchmark measure what a plain torch.distributed timing loop measures (0.95x at least)?

What is measured (2 MPI engines from `nbdist.start(2)`, torch.distributed initialised by nbdist on its CPU default,
the mpi4py backend; the rows name it):

1. all-reduce busbw at each size (default 1 KiB, 4 KiB, ..., 64 MiB): `nbdist.collectives.benchmark(ops=
   ("all_reduce",), via=("torch",), sizes=(S,))` against a minimal hand-written script run on the engines: a
   `torch.ones` float32 buffer of S bytes, the same number of warm-up calls, `dist.barrier()`, k back-to-back
   `dist.all_reduce` calls timed with perf_counter, t = loop / k, the slowest rank's t, busbw = S / t × 2(n-1)/n.
   k is the iteration count nbdist chose for that size in an untimed first round, so both loops last as long.
   Every repetition runs every size on both sides, who goes first alternating (by size and repetition); the
   ratio nbdist busbw / plain busbw is taken per repetition, its median per size, and the median of those over
   the sizes. Target: median ratio >= 0.95 (per-size rows are shown, informative).
Also shown, for context (not counted):
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
import statistics
import sys

import on_ranks
from common import Measure, Run, format_table
from workloads import parse_size

import nbdist
from nbdist.collectives.sweep import BenchmarkResult
from nbdist.collectives.sweep import benchmark as nbdist_benchmark
from nbdist.units import format_bytes

N_ENGINES = 2
RATIO_TARGET = 0.95
DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M"
WARMUP = 5
ISSUE_QUOTES = {1024: (1.5e-3, 8e-6), 4 * 2**20: (3.1e-3, 0.64e-3), 16 * 2**20: (11e-3, 3.1e-3)}  # gloo, MPI s


def plain_busbw(cluster: nbdist.Cluster, size: int, k: int) -> float:
    """busbw (GB/s) of the plain loop: the slowest rank's seconds per all-reduce, nccl-tests' factor 2(n-1)/n."""
    seconds = max(cluster.run(on_ranks.plain_all_reduce, size, k, WARMUP))
    n = cluster.world_size
    return size / seconds / 1e9 * 2 * (n - 1) / n


def nbdist_row(cluster: nbdist.Cluster, size: int, via=("torch",)) -> BenchmarkResult:
    return nbdist_benchmark(ops=("all_reduce",), via=via, sizes=(size,), cluster=cluster, warmup=WARMUP)


# -- the question: nbdist against the plain loop ------------------------------------------------------------------


def measure_against_plain(cluster: nbdist.Cluster, sizes: list[int], repeats: int, log) -> tuple[list[Measure], dict]:
    """Per size, nbdist's and the plain loop's busbw per repetition (interleaved): one row each (informative),
    and the counted row: the median over the sizes of the per-size median ratios."""
    iters = {}
    for size in sizes:  # untimed round: warms both sides up and fixes the plain loop's k to nbdist's choice
        iters[size] = nbdist_row(cluster, size)[0]["iters"]
        plain_busbw(cluster, size, iters[size])
    ours: dict[int, list[float]] = {size: [] for size in sizes}
    plain: dict[int, list[float]] = {size: [] for size in sizes}
    for rep in range(repeats):
        for i, size in enumerate(sizes):
            for side in ("nbdist", "plain") if (rep + i) % 2 == 0 else ("plain", "nbdist"):
                if side == "nbdist":
                    ours[size].append(nbdist_row(cluster, size)[0]["busbw"])
                else:
                    plain[size].append(plain_busbw(cluster, size, iters[size]))
        log(f"  repetition {rep + 1}/{repeats}: nbdist/plain busbw per size "
            + " ".join(f"{ours[s][-1] / plain[s][-1]:.2f}" for s in sizes))
    backend = cluster.run(lambda: __import__("torch.distributed").distributed.get_backend())[0]
    rows = [Measure(f"all_reduce {format_bytes(size)} busbw, via torch ({backend})", "GB/s", ours[size], plain[size],
                    "ratio>=", RATIO_TARGET, counts=False, anchor_name="plain loop",
                    notes={"plain_iters": iters[size]}) for size in sizes]
    medians = [statistics.median(m.per_repetition) for m in rows]
    overall = Measure("all sizes: median of the per-size median ratios nbdist/plain", "x", medians, [], "abs>=",
                      RATIO_TARGET, anchor_name="plain loop", notes={"per_size_median_ratio": medians})
    return rows + [overall], iters


# -- context: gloo against MPI, the sweep, the fits ---------------------------------------------------------------


def measure_gloo_vs_mpi(cluster: nbdist.Cluster, sizes: list[int], repeats: int, log) -> dict:
    """Per size and via: seconds and busbw per repetition (nbdist alternates the two ways at each size)."""
    out = {size: {"torch": {"seconds": [], "busbw": []}, "mpi": {"seconds": [], "busbw": []}} for size in sizes}
    for rep in range(repeats):
        for size in sizes:
            for row in nbdist_row(cluster, size, via=("torch", "mpi") if rep % 2 == 0 else ("mpi", "torch")):
                out[size][row["via"]]["seconds"].append(row["seconds"])
                out[size][row["via"]]["busbw"].append(row["busbw"])
        log(f"  repetition {rep + 1}/{repeats} done")
    return out


def gloo_vs_mpi_table(data: dict) -> str:
    rows = []
    for size, per in data.items():
        t_gloo, t_mpi = (statistics.median(per[v]["seconds"]) for v in ("torch", "mpi"))
        quote = ISSUE_QUOTES.get(size)
        rows.append([format_bytes(size), _time(t_gloo), _time(t_mpi),
                     f"{statistics.median(per['torch']['busbw']):.4f}", f"{statistics.median(per['mpi']['busbw']):.4f}",
                     f"{t_gloo / t_mpi:.1f}x", f"{_time(quote[0])} / {_time(quote[1])}" if quote else ""])
    return format_table(["all_reduce", "gloo time", "MPI time", "gloo busbw (GB/s)", "MPI busbw (GB/s)",
                         "MPI speed-up", "issue quote gloo / MPI"], rows)


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def fits_text(result: BenchmarkResult, n: int = 8) -> tuple[str, dict]:
    """The alpha-beta fit of the all-reduce through each way, and the ring-vs-tree crossover it predicts."""
    lines, out = [], {}
    for via in ("torch", "mpi"):
        fit = result.fit("all_reduce", via)
        crossover = fit.crossover(n)
        out[via] = {"alpha_s": fit.alpha, "beta_s_per_byte": fit.beta, "bandwidth_gbps": fit.bandwidth / 1e9,
                    f"ring_beats_tree_above_bytes_n{n}": crossover}
        lines.append(f"  {fit!r}; with these as one message's cost, an {n}-rank ring all-reduce beats the binomial "
                     f"tree above {format_bytes(crossover)}")
    return "\n".join(lines), out


def details(iters: dict, gloo_vs_mpi: dict, sweep: BenchmarkResult | None) -> tuple[str, dict]:
    parts = ["plain loop: torch.ones buffer, warm-up, dist.barrier(), k dist.all_reduce timed, slowest rank; "
             "k = nbdist's choice: " + ", ".join(f"{format_bytes(s)} {k}" for s, k in iters.items()),
             "", gloo_vs_mpi_table(gloo_vs_mpi)]
    fits = {}
    if sweep is not None:
        text, fits = fits_text(sweep)
        parts += ["", sweep.table(), "", "alpha-beta fits of the all-reduce sweep (relative least squares):", text]
    return "\n".join(parts), fits


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
    sweep = None
    with Run() as run:
        run.log(f"{N_ENGINES} engines: starting")
        cluster = run.start(N_ENGINES)
        run.log(f"1. nbdist vs a plain torch.distributed loop, all_reduce, {len(args.size_list)} sizes, "
                f"{args.repeats} repetitions")
        measures, iters = measure_against_plain(cluster, args.size_list, args.repeats, run.log)
        run.log("2. gloo vs MPI, all_reduce")
        gloo_vs_mpi = measure_gloo_vs_mpi(cluster, args.size_list, args.repeats, run.log)
        if not args.no_sweep:
            run.log("3. every op through both ways, once")
            sweep = nbdist_benchmark(sizes=args.size_list, cluster=cluster, warmup=WARMUP)
    text, fits = details(iters, gloo_vs_mpi, sweep)
    settings = {"engines": N_ENGINES, "repeats": args.repeats, "sizes": args.sizes}
    extra = {"gloo_vs_mpi": {str(k): v for k, v in gloo_vs_mpi.items()},
             "sweep": sweep.to_dicts() if sweep is not None else None, "alpha_beta": fits}
    return run.finish(measures, text, True, args.json, settings, extra)


if __name__ == "__main__":
    sys.exit(main())
