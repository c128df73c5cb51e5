"""The claims labs 40 (clusters) and 41 (many hosts) teach, checked against their references without running the
notebooks: Megatron-LM's interleaved warm-up count, the ring all-reduce and α-β algebra their exercises grade,
the published figures their prose cites, and the shape of the link sweep their text reads from.

The answer keys of both labs' graded exercises are taken from the notebooks themselves (the lines between
`### BEGIN SOLUTION` and `### END SOLUTION`) and checked on more cases than the notebooks' own test cells, so a
teacher hands out a key that is right.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from notebook_files import read_cells

from nbdist import planner
from nbdist.collectives.costmodel import fit_alpha_beta
from nbdist.cost.hardware import HDR_IB, Link
from nbdist.planner import published
from nbdist.planner.pipeline import peak_held
from nbdist.planner.shapes import place

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
LAB40, LAB41 = NOTEBOOKS / "40_clusters.ipynb", NOTEBOOKS / "41_many_hosts.ipynb"
MODEL_145B = dict(layers=80, hidden=12288, heads=96, seq=2048, vocab=51200)  # Megatron-LM Table 1's 145.6 B row


def cells(path: Path) -> list:
    return read_cells(path)


def answer_key(path: Path, grade_id: str):
    """The namespace the solution cell `grade_id` defines, run with its solution lines in place."""
    cell = next(c for c in cells(path) if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)
    namespace = {"Link": Link}
    exec(compile(cell.source, f"{path.name}:{grade_id}", "exec"), namespace)  # the teacher's key, not user input
    return namespace


# -- what the prose says -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", range(2, 9))
@pytest.mark.parametrize("v", (2, 3, 4))
def test_interleaved_warm_up_holds_what_megatron_lm_schedules(p, v):
    """Lab 40 (section 3) explains rank 0's activation memory by Megatron-LM's interleaved warm-up: rank r runs
    (p - r - 1)·2 + (v - 1)·p forwards before its first backward (megatron/core/pipeline_parallel/schedules.py),
    so it holds one more chunk than that, never more than the m·v chunks there are."""
    for m in (p, 2 * p, 4 * p):
        expected = tuple(min((p - r - 1) * 2 + (v - 1) * p + 1, m * v) for r in range(p))
        assert peak_held("interleaved-1f1b", p, m, v) == expected


def test_plain_1f1b_holds_p_minus_r_micro_batches():
    """The 1F1B side of lab 40's ratio (anchors: 1F1B's stage i holds p - i)."""
    for p in range(2, 9):
        assert peak_held("1f1b", p, 4 * p, 1) == tuple(p - r for r in range(p))


def test_lab40_cites_mt_nlg_as_its_paper_gives_it():
    """MT-NLG's throughput is in section 2.4 ("System Performance Evaluation") of arXiv 2201.11990, and the prose's
    GPUs and TFLOP/s are the ones the planner is compared with."""
    prose = "\n".join(c.source for c in cells(LAB40) if c.cell_type == "markdown")
    assert "2201.11990, section 2.4" in prose and "section 2.3" not in prose
    for run in published.MT_NLG:
        assert f"{run.gpus:,}" in prose and f"{run.published_tflops:.0f}" in prose


def test_lab40_names_its_assumptions():
    """Table 1 gives neither the micro-batch size nor the chunks per rank: the lab says both are assumed, and the
    v it assumes is published.interleaving's."""
    prose = "\n".join(c.source for c in cells(LAB40) if c.cell_type == "markdown")
    assert "assumption" in prose and "b = 1" in prose
    assert f"v = {published.interleaving(MODEL_145B['layers'], 8)}" in prose


# -- the link sweep of lab 40 section 2 and lab 41 section 3 -------------------------------------------------------


def step_with(bandwidth: float, **plan) -> float:
    model = planner.gpt(**MODEL_145B)
    hw = dataclasses.replace(planner.hardware("a100-80gb"), inter_host=Link("swept", bandwidth, HDR_IB.latency))
    return planner.predict(model, hw, gpus=1536, global_batch=2304, recompute="full", **plan).step_seconds


@pytest.mark.parametrize("plan", [dict(tp=8, pp=8, chunks=2), dict(tp=8, pp=1, zero=3, sequence_parallel=True)],
                         ids=["3D", "ZeRO-3"])
@pytest.mark.slow
def test_a_slower_link_between_hosts_never_shortens_the_step(plan):
    bandwidths = [1e9 * 2 ** k for k in range(9)]  # 1 ... 256 GB/s per GPU
    steps = [step_with(b, **plan) for b in bandwidths]
    assert all(slow >= fast for slow, fast in zip(steps, steps[1:]))


def test_zero3_follows_the_link_where_it_is_slow():
    """Lab 40: 'halve the bandwidth, double the step' for ZeRO-3 on a slow network: its gathers across hosts are
    bytes / bandwidth (the ring all-gather) and swamp the compute."""
    plan = dict(tp=8, pp=1, zero=3, sequence_parallel=True)
    slow = 100e9 / 8 / 8  # 100 Gb/s Ethernet shared by a host's 8 GPUs
    assert step_with(slow / 2, **plan) / step_with(slow, **plan) == pytest.approx(2, rel=0.05)


# -- the graded exercises' answer keys -----------------------------------------------------------------------------


@pytest.mark.parametrize("members", range(1, 9))
@pytest.mark.parametrize("profile", ["a100-80gb", "h100-sxm"])
def test_lab40_key_prices_a_ring_as_the_planner_does(members, profile):
    tp_all_reduce_seconds = answer_key(LAB40, "40-tp-all-reduce")["tp_all_reduce_seconds"]
    hw = planner.hardware(profile)
    group = place(list(range(members)), hw)  # one host: the NVLink of the profile
    for size in (1.0, 2.0**20, 48 * 2.0**20, 1e9):
        assert math.isclose(tp_all_reduce_seconds(size, members, hw.intra_host), group.all_reduce(size),
                            rel_tol=1e-12, abs_tol=0.0)


@pytest.mark.parametrize("alpha, bandwidth", [(5e-6, 25e9), (14e-6, 6e9), (50e-6, 1.25e9)])
def test_lab41_key_finds_where_a_message_reaches_half_the_bandwidth(alpha, bandwidth):
    """n½ of a fit recovered from points on a line: t(n½) = 2α, and n½ / t(n½) is half the bandwidth."""
    half_bandwidth_bytes = answer_key(LAB41, "41-half-bandwidth")["half_bandwidth_bytes"]
    rows = [{"op": "all_reduce", "via": "torch", "size_bytes": s, "seconds": alpha + s / bandwidth}
            for s in (4**k for k in range(6, 13))]
    fit = fit_alpha_beta(rows)
    size = half_bandwidth_bytes(fit)
    assert size == pytest.approx(alpha * bandwidth, rel=1e-6)
    assert size / fit.predict(size) == pytest.approx(bandwidth / 2, rel=1e-6)
