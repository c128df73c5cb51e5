"""The collectives benchmark on the real 2-engine cluster (every op through torch.distributed, on CPU engines the mpi4py backend, and MPI, checked), its input
validation, and the alpha-beta model on synthetic rows (exact arithmetic)."""
import math
import subprocess
import sys

import pytest

from nbdist.collectives import OPS, AlphaBeta, BenchmarkResult, benchmark, fit_alpha_beta
from nbdist.collectives.replies import MpiWorld
from nbdist.errors import DistError, DistUsageError

BUSBW_FACTOR_2_RANKS = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0,
                        "all_to_all": 0.5}  # 2(n-1)/n, (n-1)/n, (n-1)/n, 1, (n-1)/n at n = 2


@pytest.fixture(scope="module")
def sweep(cluster):
    return benchmark(sizes=[1024, 65536], cluster=cluster, iters=4, warmup=1)


def test_every_op_and_via_is_checked_and_has_nccl_tests_bandwidths(sweep):
    assert OPS == ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
    assert isinstance(sweep, BenchmarkResult) and len(sweep) == 5 * 2 * 2
    assert {(r["op"], r["via"], r["size_bytes"]) for r in sweep} == {
        (op, via, size) for op in OPS for via in ("torch", "mpi") for size in (1024, 65536)
    }
    for row in sweep:
        assert row["checked"] and row["ranks"] == 2 and row["iters"] == 4 and row["seconds"] > 0
        assert row["algbw"] == pytest.approx(row["size_bytes"] / row["seconds"] / 1e9, rel=1e-12)
        assert row["busbw"] == pytest.approx(row["algbw"] * BUSBW_FACTOR_2_RANKS[row["op"]], rel=1e-12)
    assert sweep.to_dicts() == sweep.rows and sweep.to_dicts()[0] is not sweep.rows[0]


def test_reduce_scatter_is_native_on_the_mpi_backend(sweep):
    """gloo has no reduce-scatter (torch emulates it with an all-reduce, and the row says so: tested on a "cpu:gloo"
    group in test_devices.py); CPU engines' default backend, mpi4py, has one, so no row carries that note."""
    assert {r["backend"] for r in sweep.select(via="torch")} == {"mpi4py"}
    assert all("all-reduce" not in row["note"] for row in sweep), [r["note"] for r in sweep]
    assert "gloo has no reduce-scatter" not in sweep.table()


def test_table_html_and_figure(sweep):
    text = sweep.table()
    assert text.splitlines()[0].split()[:3] == ["op", "via", "size"] and "busbw (GB/s)" in text
    assert "64 KiB" in text and "mpi (" in text
    assert sweep._repr_html_().startswith("<table><tr><th>op</th>")
    fig = sweep.figure()
    assert len(fig.data) == 10  # one line per (op, via)
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    dash = {trace.name.split(" (")[0]: trace.line.dash for trace in fig.data}
    assert dash["all_reduce, torch"] == "solid" and dash["all_reduce, mpi"] == "dash"


def test_benchmark_is_the_function_whatever_was_imported_first():
    import nbdist.collectives.sweep
    import nbdist.collectives.tracing

    assert nbdist.collectives.benchmark is benchmark and callable(benchmark)
    assert callable(nbdist.collectives.trace) and nbdist.collectives.trace.__module__ == "nbdist.collectives.tracing"


def test_collectives_are_reachable_from_a_bare_import_nbdist():
    """`import nbdist; nbdist.collectives.benchmark(...)` without importing the submodule first (a fresh process:
    nothing imported before)."""
    code = ("import nbdist; f = nbdist.collectives.benchmark; t = nbdist.collectives.trace; "
            "print(f.__module__, t.__module__, nbdist.collectives.OPS[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["nbdist.collectives.sweep", "nbdist.collectives.tracing", "all_reduce"]


def test_iterations_are_chosen_for_a_measurable_loop(cluster):
    row = benchmark(ops="broadcast", via="mpi", sizes=4096, cluster=cluster, warmup=2, target_seconds=0.02)[0]
    assert row["iters"] > 10  # a 4 KiB broadcast takes microseconds: many of them make one loop
    assert row["iters"] * row["seconds"] < 1.0  # and not so many that the loop runs away (timings vary too
    # much on a shared machine to assert a lower bound on the loop's length)


def test_only_chunked_ops_need_sizes_divisible_by_the_ranks(cluster):
    rows = benchmark(ops="all_reduce", via="mpi", sizes=1028, cluster=cluster, iters=2, warmup=0)
    assert rows[0]["checked"] and rows[0]["size_bytes"] == 1028


def test_ranks_picks_the_first_ranks(cluster):
    """ranks=1 on 2 engines: rank 0 alone, in a group (and MPI communicator) of its own; rank 1 only helps make
    them. Checked like any row; busbw is 0 for an all-reduce on one rank (nothing moves)."""
    rows = benchmark(ops=("broadcast", "all_reduce"), sizes=1024, ranks=1, cluster=cluster, iters=2, warmup=0)
    assert [(r["op"], r["via"], r["ranks"], r["checked"]) for r in rows] == [
        ("broadcast", "torch", 1, True), ("broadcast", "mpi", 1, True),
        ("all_reduce", "torch", 1, True), ("all_reduce", "mpi", 1, True)]
    assert [r["busbw"] for r in rows if r["op"] == "all_reduce"] == [0.0, 0.0]
    assert benchmark(ops="broadcast", via="mpi", sizes=1024, cluster=cluster, iters=2, warmup=0)[0]["ranks"] == 2


def _engine_break_expected(broken: bool) -> None:
    import importlib

    cls = importlib.import_module("nbdist.collectives.ranks.collective_timing").Collective
    if broken:
        cls._original_expected = cls.expected
        cls.expected = lambda self: cls._original_expected(self) + 1
    else:
        cls.expected = cls._original_expected


def test_a_wrong_result_raises_naming_op_via_and_size(cluster):
    cluster.run(_engine_break_expected, True, ranks=[1])
    try:
        with pytest.raises(DistError, match=r"all_gather via mpi at 1024 bytes gave a wrong result: rank 1: element 0"):
            benchmark(ops="all_gather", via="mpi", sizes=1024, cluster=cluster, iters=1, warmup=0)
    finally:
        cluster.run(_engine_break_expected, False, ranks=[1])
    assert benchmark(ops="all_gather", via="mpi", sizes=1024, cluster=cluster, iters=1, warmup=0)[0]["checked"]


def _engine_torch_lacks_ops(lacking: bool) -> None:
    import importlib

    cls = importlib.import_module("nbdist.collectives.ranks.collective_timing").Collective
    if lacking:
        def unsupported(self):
            def call():
                raise RuntimeError(f"ProcessGroupGloo does not support {self.op}\nmore detail")
            return call

        cls._original_torch_call, cls._torch_call = cls._torch_call, unsupported
    else:
        cls._torch_call = cls._original_torch_call


def test_an_op_the_backend_lacks_is_a_row_without_a_time(cluster):
    cluster.run(_engine_torch_lacks_ops, True)
    try:
        result = benchmark(ops="all_to_all", sizes=1024, cluster=cluster, iters=1, warmup=0)
    finally:
        cluster.run(_engine_torch_lacks_ops, False)
    lacking, measured = result.select(via="torch")[0], result.select(via="mpi")[0]
    assert lacking["seconds"] is None and lacking["busbw"] is None and not lacking["checked"]
    assert lacking["note"] == "mpi4py: ProcessGroupGloo does not support all_to_all"  # the backend, then the error
    assert measured["checked"] and measured["seconds"] > 0
    assert "not run [1]" in result.table() and len(result.figure().data) == 1


class _FakeCluster:
    """Two ranks whose MPI world is described by `worlds`; records what would have run on the engines."""

    world_size = 2

    def __init__(self, worlds: list[MpiWorld]):
        self.worlds, self.calls = worlds, []

    def run(self, fn, *args, **kwargs):
        self.calls.append(fn.__name__)
        if fn.__name__ == "mpi_world":
            return self.worlds
        raise AssertionError(f"{fn.__name__} started on the engines after a failed validation")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sizes": 0}, "sizes must be positive"),
        ({"sizes": [1024, -8]}, "sizes must be positive"),
        ({"sizes": 10.0}, "sizes must be positive whole numbers"),
        ({"sizes": []}, "no sizes given"),
        ({"sizes": 1026, "ops": "all_reduce"}, "not a whole number of float32 elements"),
        ({"sizes": 1028, "ops": ("all_reduce", "all_to_all")}, "all_to_all needs one equal float32 chunk per rank, "
                                                               "so a multiple of world size × 4 = 8 bytes"),
        ({"ops": "allreduce"}, "unknown op 'allreduce': choose all_reduce, all_gather"),
        ({"via": "nccl"}, "unknown via 'nccl': choose torch, mpi"),
        ({"ops": []}, "no op given: choose all_reduce, all_gather"),
        ({"iters": 0}, r"iters \(or None: chosen for you\) must be at least 1, got 0"),
        ({"iters": 2.0}, r"iters \(or None: chosen for you\) must be a whole number, got 2.0"),
        ({"warmup": -1}, "warmup must be at least 0, got -1"),
        ({"target_seconds": "0.1"}, "target_seconds must be a number of seconds, got '0.1'"),
        ({"ranks": 3}, "ranks must be a whole number from 1 to 2"),
        ({"ranks": 0}, "ranks must be a whole number from 1 to 2"),
        ({"ranks": True}, "ranks must be a whole number from 1 to 2"),
    ],
)
def test_bad_input_raises_before_anything_runs(kwargs, message):
    fake = _FakeCluster([])
    with pytest.raises(DistUsageError, match=message):
        benchmark(cluster=fake, **kwargs)
    assert fake.calls == []


@pytest.mark.parametrize(
    "worlds, message",
    [
        ([MpiWorld(r, 2, 0, 1) for r in (0, 1)], "rank 0 is MPI rank 0 of 1 and torch rank 0 of 2"),
        ([MpiWorld(r, 2, problem="mpi4py cannot be imported on the engines (no module)") for r in (0, 1)],
         "rank 0: mpi4py cannot be imported"),
    ],
)
def test_mpi_without_a_matching_mpi_world_is_refused_after_asking_the_engines(worlds, message):
    fake = _FakeCluster(worlds)
    with pytest.raises(DistUsageError, match=message):
        benchmark(ops="all_reduce", sizes=1024, via=("torch", "mpi"), cluster=fake)
    assert fake.calls == ["mpi_world"]  # no collective started


# -- the alpha-beta model ----------------------------------------------------------------------------------------

ALPHA, BETA = 25e-6, 2.5e-10  # 25 us, 4 GB/s


def synthetic_rows(alpha=ALPHA, beta=BETA, op="all_reduce", via="torch", sizes=(1024, 16384, 2**20, 2**26)):
    return [{"op": op, "via": via, "size_bytes": s, "seconds": alpha + beta * s, "ranks": 2} for s in sizes]


@pytest.mark.parametrize("relative", [True, False])
def test_fit_recovers_alpha_and_beta_exactly(relative):
    rows = synthetic_rows() + synthetic_rows(1.0, 1.0, via="mpi") + synthetic_rows(2.0, 1.0, op="broadcast")
    fit = fit_alpha_beta(rows, relative=relative)
    assert isinstance(fit, AlphaBeta) and (fit.op, fit.via, fit.ranks) == ("all_reduce", "torch", 2)
    assert fit.alpha == pytest.approx(ALPHA, rel=1e-9) and fit.beta == pytest.approx(BETA, rel=1e-9)
    assert fit.bandwidth == pytest.approx(4e9, rel=1e-9)
    assert fit.predict(2**20) == pytest.approx(ALPHA + BETA * 2**20, rel=1e-9)
    assert list(fit.predict([0, 1000])) == pytest.approx([ALPHA, ALPHA + 1000 * BETA], rel=1e-9)
    assert "4 GB/s" in repr(fit)


def test_fit_of_a_benchmark_result_and_too_few_points():
    result = BenchmarkResult(synthetic_rows())
    assert result.fit().alpha == pytest.approx(ALPHA, rel=1e-9)
    with pytest.raises(DistUsageError, match="needs measured rows at 2 or more sizes; the rows have all_reduce"):
        fit_alpha_beta(synthetic_rows(sizes=(1024,)) + synthetic_rows(via="mpi"), via="torch")
    with pytest.raises(DistUsageError, match="all_gather via torch"):
        fit_alpha_beta(result, op="all_gather")


def test_algorithm_costs_are_the_classic_formulas():
    fit = AlphaBeta(ALPHA, BETA)
    s, n = 2**20, 8
    assert fit.ring(s, n) == pytest.approx(2 * 7 * ALPHA + 2 * 7 / 8 * s * BETA)
    assert fit.tree(s, n) == pytest.approx(2 * 3 * (ALPHA + s * BETA))
    assert fit.recursive_doubling(s, n) == pytest.approx(3 * (ALPHA + s * BETA))
    with pytest.raises(DistUsageError, match="n >= 2 ranks"):
        fit.ring(s, 1)


@pytest.mark.parametrize("n", [4, 6, 8, 64])
def test_crossover_is_where_ring_and_tree_cross(n):
    fit = AlphaBeta(ALPHA, BETA)
    x = fit.crossover(n)
    assert 0 < x < math.inf
    assert fit.ring(x, n) == pytest.approx(fit.tree(x, n), rel=1e-12)
    assert fit.ring(x / 2, n) > fit.tree(x / 2, n) and fit.ring(2 * x, n) < fit.tree(2 * x, n)
    y = fit.crossover(n, versus="recursive_doubling")
    assert fit.ring(y, n) == pytest.approx(fit.recursive_doubling(y, n), rel=1e-12) and y > x


def test_crossover_closed_form_and_two_ranks():
    fit = AlphaBeta(ALPHA, BETA)
    assert fit.crossover(4) == pytest.approx(0.8 * ALPHA / BETA)  # 2α / (2.5β)
    assert fit.crossover(2) == 0.0  # same latency as the tree, half the bytes: the ring is never slower
    assert fit.crossover(2, versus="recursive_doubling") == math.inf  # one exchange: the ring never wins


def test_alpha_beta_figure():
    fit = fit_alpha_beta(synthetic_rows())
    fig = fit.figure(n=8)
    names = [trace.name for trace in fig.data]
    assert names[0].startswith("measured") and names[1].startswith("fit")
    assert any(name.startswith("ring") for name in names) and any("tree" in name for name in names)
    assert len(fig.data) == 5 and fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    assert len(fig.layout.shapes) == 1  # the crossover line
    assert "ring beats tree above" in fig.layout.title.text
    assert len(fit.figure().layout.shapes) == 0  # n = 2 (the measured ranks): no crossover
