"""Hand-built all-reduce (ring, tree, recursive doubling; nbdist/collectives/ranks/allreduce.py) on a real 8-engine cluster,
against dist.all_reduce, traced from the notebook (nbdist/collectives/tracing.py), and the one cost table
(nbdist.cost.collectives) against what the algorithms really send.

One 8-engine cluster covers 2 to 8 ranks: the algorithms take a process group, and `trace(world_size=n)` runs
them on the group of ranks 0..n-1 (3, 5 and 6 are the non-power-of-two cases: the tree's missing partners and
recursive doubling's fold-in / fold-out).
"""
import ast
import math
import pathlib

import pytest
import torch

import nbdist
from nbdist.cluster.options import ClusterOptions
from nbdist.collectives import benchmark, costmodel, message_counts, trace
from nbdist.collectives.tracing import Trace
from nbdist.cost import collectives as costs
from nbdist.errors import DistError, DistUsageError

NAMES = ["ring", "tree", "recursive-doubling"]
RANKS = [2, 3, 4, 5, 6, 8]


@pytest.fixture(scope="module")
def eight(shared_clusters):
    shared_clusters.release(4)  # one big cluster at a time on 2 cores: the next test that uses cluster4 restarts it
    cluster = nbdist.Cluster(ClusterOptions(n=8)).start()
    yield cluster
    cluster.stop()


def expected_steps(name: str, n: int) -> int:
    if name == "ring":
        return 2 * (n - 1)
    if name == "tree":
        return 2 * math.ceil(math.log2(n))
    power = 2 ** int(math.log2(n))
    return int(math.log2(power)) + (0 if power == n else 2)  # fold-in and fold-out beyond the power of two


@pytest.mark.parametrize("size", [12, 13, 2])  # divides by 2, 3 and 4; divides by none; fewer elements than ranks
@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("name", NAMES)
def test_equals_library_all_reduce(eight, name, n, size):
    t = trace(name, world_size=n, size=size, cluster=eight, seed=size)
    assert t.matches_library and t.max_diff <= 1e-5
    assert t.world_size == n and sum(t.chunk_sizes) == size
    assert len(t.chunk_sizes) == (n if name == "ring" else 1)
    assert all(h == list(range(n)) for holds in t.steps[-1]["holds"] for h in holds)  # every chunk reduced


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("name", NAMES)
def test_record_has_the_expected_steps(eight, name, n):
    t = trace(name, world_size=n, size=16, cluster=eight)
    assert len(t.steps) == expected_steps(name, n) == message_counts(name, n, 64).steps
    assert [s["step"] for s in t.steps] == list(range(1, len(t.steps) + 1))
    assert all(len(s["holds"]) == n for s in t.steps)


def test_ring_moves_one_chunk_to_the_right_per_step(eight):
    n = 4
    t = trace("ring", world_size=n, size=16, cluster=eight)
    assert [s["phase"] for s in t.steps] == ["reduce-scatter"] * (n - 1) + ["all-gather"] * (n - 1)
    for s in t.steps:
        assert sorted((src, dst) for src, dst, _ in s["sends"]) == [(r, (r + 1) % n) for r in range(n)]
    after_reduce_scatter = t.steps[n - 2]["holds"]
    for r in range(n):  # rank r ends the reduce-scatter with the full sum of chunk r+1, and of no other
        full = [c for c, h in enumerate(after_reduce_scatter[r]) if h == list(range(n))]
        assert full == [(r + 1) % n]
    assert t.bytes_sent == [message_counts("ring", n, 64).busiest_rank_bytes] * n  # 2(n-1) chunks of S/n each


def test_tree_and_recursive_doubling_send_whole_tensors(eight):
    tree = trace("tree", world_size=4, size=16, cluster=eight)
    assert [s["phase"] for s in tree.steps] == ["reduce", "reduce", "broadcast", "broadcast"]
    assert tree.steps[0]["sends"] == [(1, 0, 0), (3, 2, 0)] and tree.steps[1]["sends"] == [(2, 0, 0)]
    assert tree.bytes_sent == [128, 64, 128, 64]  # rank 0 sends only in the broadcast; ranks 1 and 3 only reduce
    doubling = trace("recursive-doubling", world_size=4, size=16, cluster=eight)
    assert doubling.steps[1]["sends"] == [(0, 2, 0), (1, 3, 0), (2, 0, 0), (3, 1, 0)]  # partners: rank XOR 2
    assert doubling.bytes_sent == [2 * 64] * 4


def test_recursive_doubling_folds_the_extra_rank_in_and_out(eight):
    t = trace("recursive-doubling", world_size=3, size=5, cluster=eight)
    assert [s["phase"] for s in t.steps] == ["fold-in", "exchange", "fold-out"]
    assert t.steps[0]["sends"] == [(2, 0, 0)] and t.steps[-1]["sends"] == [(0, 2, 0)]
    assert t.steps[0]["holds"] == [[[0, 2]], [[1]], [[2]]]


def _direct_call(name: str, n: int):
    """Engine side: the algorithm called as a user would, on a non-contiguous int64 tensor and a group of n."""
    import torch
    import torch.distributed as dist

    from nbdist.cluster.meshes.ranks import groups
    from nbdist.collectives.ranks import allreduce

    group = groups.first_ranks(n)
    if dist.get_rank() >= n:
        return None
    rank = dist.get_rank(group)
    x = torch.arange(6).reshape(2, 3).t() * (rank + 1)
    record = []
    out = allreduce.ALGORITHMS[name](x, group, record)
    return out is x and not x.is_contiguous(), x, len(record)


@pytest.mark.parametrize("name", NAMES)
def test_in_place_on_integer_non_contiguous_tensors(eight, name):
    for n in (1, 3):
        results = eight.run(_direct_call, name, n)[:n]
        for same_object, x, steps in results:
            assert same_object
            assert torch.equal(x, torch.arange(6).reshape(2, 3).t() * (n * (n + 1) // 2))
            assert steps == (0 if n == 1 else expected_steps(name, n))  # one rank: a no-op without steps


def _bool_all_reduce():
    import torch

    from nbdist.collectives.ranks.allreduce import ring_all_reduce

    ring_all_reduce(torch.ones(3, dtype=torch.bool))


def test_bad_input_raises(eight):
    with pytest.raises(DistUsageError, match="unknown all-reduce algorithm 'butterfly'"):
        trace("butterfly", cluster=eight)
    for world_size in (1, 9, 2.0):
        with pytest.raises(DistUsageError, match="world_size"):
            trace("ring", world_size=world_size, cluster=eight)
    with pytest.raises(DistUsageError, match="size"):
        trace("ring", size=0, cluster=eight)
    with pytest.raises(DistError, match="DistUsageError.*floating or integer"):
        eight.run(_bool_all_reduce)
    assert trace("ring", cluster=eight, size=8).matches_library  # the cluster still works


def test_message_counts():
    ring = message_counts("ring", 4, 4096)
    assert (ring.steps, ring.message_bytes, ring.critical_path_bytes, ring.busiest_rank_bytes) == (6, 1024, 6144, 6144)
    assert message_counts("ring", 3, 40).message_bytes == 16  # 10 floats: chunks of 4, 3, 3
    tree = message_counts("tree", 8, 64)
    assert message_counts("tree", 3, 64).steps == 4
    assert (tree.critical_path_bytes, tree.busiest_rank_bytes) == (6 * 64, 3 * 64)  # rank 0 sends in 3 rounds of 6
    assert [message_counts("recursive-doubling", n, 64).steps for n in (2, 4, 6, 8)] == [1, 2, 4, 3]
    assert message_counts("ring", 1, 64).steps == 0
    assert message_counts("tree", 4, 64).seconds(alpha=1e-6, beta=1e-9) == pytest.approx(4e-6 + 256e-9)
    with pytest.raises(DistUsageError):
        message_counts("butterfly", 4, 64)
    with pytest.raises(DistUsageError):
        message_counts("ring", 4, 6)  # not whole float32 elements
    with pytest.raises(DistUsageError):
        message_counts("ring", 0, 64)


@pytest.mark.parametrize("name,n", [("ring", 4), ("tree", 3), ("recursive-doubling", 3)])
def test_figure_has_one_frame_per_step_and_a_slider(eight, name, n):
    t = trace(name, world_size=n, size=10, cluster=eight)
    fig = t.figure()
    assert len(fig.frames) == len(t.steps)
    assert [s.label for s in fig.layout.sliders[0].steps] == [str(k) for k in range(1, len(t.steps) + 1)]
    for frame, step in zip(fig.frames, t.steps):
        assert f"step {step['step']} of {len(t.steps)}, {step['phase']}" in frame.layout.title.text
        assert name in frame.layout.title.text
        arrows = [a for a in frame.layout.annotations if a.showarrow]
        assert len(arrows) == len(step["sends"])
        counts = [len(h) for holds in step["holds"] for h in holds]
        assert list(frame.data[0].marker.color) == counts
    data = fig.to_plotly_json()  # static JSON: frames and slider travel with the figure
    assert len(data["frames"]) == len(t.steps) and data["layout"]["sliders"]
    assert "plotly" in fig.to_html(include_plotlyjs=False, full_html=False)


@pytest.mark.parametrize("size", [120, 13])  # 120 floats divide by every n here; 13 by none (uneven ring chunks)
@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("name", NAMES)
def test_cost_table_is_what_the_algorithms_send(eight, name, n, size):
    """The one table that costmodel and message_counts read agrees with the record of a real run: its steps, its
    critical path (each step's largest message, summed) and what the busiest rank sends."""
    t = trace(name, world_size=n, size=size, cluster=eight)
    counts = message_counts(name, n, 4 * size)
    assert (len(t.steps), t.critical_path_bytes, max(t.bytes_sent)) == (
        counts.steps, counts.critical_path_bytes, counts.busiest_rank_bytes)
    assert counts.steps == costs.steps(name, n) == expected_steps(name, n)
    if size % n == 0:  # whole chunks: the alpha-beta model's coefficients are the same counts, per byte of S
        steps, per_byte = costmodel.coefficients(name, n)
        assert steps == counts.steps and per_byte == pytest.approx(counts.critical_path_bytes / (4 * size))
        assert max(t.bytes_sent) == pytest.approx(costs.busiest_rank_share(name, n) * 4 * size)
        fit = costmodel.AlphaBeta(alpha=1e-5, beta=1e-9)
        assert fit.cost(name, 4 * size, n) == pytest.approx(counts.seconds(1e-5, 1e-9))


def test_one_spelling_and_one_alias_everywhere(eight):
    assert trace("recursive_doubling", world_size=3, size=4, cluster=eight).algorithm == "recursive-doubling"
    assert message_counts("recursive_doubling", 6, 64) == message_counts("recursive-doubling", 6, 64)
    fit = costmodel.AlphaBeta(alpha=1e-5, beta=1e-9)
    assert fit.cost("recursive_doubling", 1024, 6) == fit.cost("recursive-doubling", 1024, 6)
    assert fit.recursive_doubling(1024, 6) == fit.cost("recursive-doubling", 1024, 6)
    assert fit.crossover(6, versus="recursive_doubling") == fit.crossover(6, versus="recursive-doubling")
    for wrong in ("Recursive-Doubling", "recursive doubling", "rd", None):
        with pytest.raises(DistUsageError, match="unknown all-reduce algorithm"):
            message_counts(wrong, 4, 64)
        with pytest.raises(DistUsageError, match="unknown all-reduce algorithm"):
            fit.cost(wrong, 64, 4)
    assert "n=6: 4α + 4·Sβ" in costs.legend("recursive_doubling", 6)  # fold-in, 2 exchanges, fold-out


def test_benchmark_among_the_first_ranks_only(eight):
    """ranks=2 on an 8-rank cluster: a 2-rank broadcast (one message: the alpha-beta model's unit), checked."""
    rows = benchmark(ops=("broadcast", "all_reduce"), sizes=[1024, 4096], ranks=2, cluster=eight, iters=3, warmup=1)
    assert len(rows) == 2 * 2 * 2 and all(r["ranks"] == 2 and r["checked"] and r["seconds"] > 0 for r in rows)
    assert all(r["busbw"] == pytest.approx(r["algbw"]) for r in rows)  # 2(n-1)/n = 1 at n = 2, like broadcast's 1
    fit = rows.fit("broadcast", "mpi")
    assert fit.ranks == 2 and fit.op == "broadcast"
    assert benchmark(ops="all_reduce", sizes=1024, cluster=eight, iters=2, warmup=0)[0]["ranks"] == 8  # all again


def test_trace_repr_says_what_ran(eight):
    text = repr(trace("recursive-doubling", world_size=2, size=4, cluster=eight))
    assert "recursive-doubling all-reduce on 2 ranks" in text and "1 step," in text and "matches" in text


def _engine_break_ring(broken: bool) -> None:
    """Fault injection on this rank: the ring's result off by one after it ran (the record stays the real one)."""
    from nbdist.collectives.ranks import allreduce

    if broken:
        real = allreduce.ALGORITHMS["ring"]

        def off_by_one(tensor, group=None, record=None):
            return real(tensor, group, record).add_(1.0)

        off_by_one.real = real
        allreduce.ALGORITHMS["ring"] = off_by_one
    else:
        allreduce.ALGORITHMS["ring"] = allreduce.ALGORITHMS["ring"].real


def test_a_trace_that_differs_from_the_library_says_so(eight):
    """matches_library is measured: a result off by one on one rank gives a trace whose max_diff is 1, which says
    DIFFERS in its repr and its figure, and still shows its (real, complete) steps."""
    eight.run(_engine_break_ring, True, ranks=[2])
    try:
        t = trace("ring", world_size=4, size=8, cluster=eight)
    finally:
        eight.run(_engine_break_ring, False, ranks=[2])
    assert not t.matches_library and t.max_diff == pytest.approx(1.0, abs=1e-5) and t.max_diff > t.tolerance
    assert "DIFFERS FROM dist.all_reduce (max diff 1" in repr(t)
    fig = t.figure()
    assert all("DIFFERS FROM dist.all_reduce" in frame.layout.title.text for frame in fig.frames)
    assert len(t.steps) == costs.steps("ring", 4)
    healthy = trace("ring", world_size=4, size=8, cluster=eight)
    assert healthy.matches_library and "DIFFERS" not in repr(healthy) + healthy.figure().layout.title.text
    assert f"the result {healthy.verdict}" in healthy.figure().layout.title.text


def test_matches_library_is_computed_from_the_difference():
    def made(max_diff: float, scale: float) -> Trace:
        return Trace("ring", 2, 2, [1, 1], [], max_diff=max_diff, scale=scale)

    assert made(0.0, 0.0).matches_library and made(1e-5, 0.5).matches_library  # tolerance at least 1e-5
    assert not made(2e-5, 0.5).matches_library
    assert made(0.9e-3, 100.0).matches_library and not made(1.1e-3, 100.0).matches_library  # relative to the sum
    assert not made(float("nan"), 1.0).matches_library


def test_the_groups_made_for_traces_live_in_the_engine_registry(eight):
    trace("tree", world_size=3, size=4, cluster=eight)
    held = [row for row in eight.holdings() if (row["kind"], row["name"]) == ("group", "ranks:0,1,2")]
    assert sorted(row["rank"] for row in held) == list(range(8))  # new_group is collective: every rank holds it
    assert held[0]["what"] == "torch group of ranks [0, 1, 2]"


@pytest.mark.slow
def test_one_spelling_of_each_name_on_both_sides():
    """The engines' algorithms and the figures' styles are keyed by the cost table's names, and only the table
    knows the alias."""
    from nbdist.collectives.ranks import allreduce
    from nbdist.viz.collectives import ALGORITHM_STYLES

    assert tuple(allreduce.ALGORITHMS) == tuple(ALGORITHM_STYLES) == costs.ALGORITHMS
    assert costs.canonical("recursive_doubling") == "recursive-doubling" and costs.ALIASES == {
        "recursive_doubling": "recursive-doubling"}
    assert not hasattr(nbdist.collectives, "ring_all_reduce")  # rank code is reached through nbdist.collectives.ranks
    package = pathlib.Path(nbdist.__file__).parent
    spelled = {str(path.relative_to(package)) for path in package.rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Constant) and node.value == "recursive_doubling"}
    assert spelled == {"cost/collectives.py"}  # the alias, as a string, in one module
