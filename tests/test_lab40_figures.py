"""Lab 40's figures and words as a learner reads them (faults found walking the lab in JupyterLab at 1000 and
1600 px), checked on the figures' data without a browser: log axes that hold their curves and marks, one colour
per meaning across figures, counts and durations in words, labels that do not overlap, and the cluster planner's
controls wrapping instead of being cut off in a narrow notebook.
"""
from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import pytest
from notebook_files import read_cells

from nbdist import planner
from nbdist.cost.hardware import HDR_IB, NDR_IB, NVLINK4
from nbdist.planner import published
from nbdist.planner.figures import link_sweep_figure, scaling_terms_figure
from nbdist.planner.prediction import TIME_TERMS
from nbdist.planner.widget import SLIDER_MIN, ClusterPlannerView
from nbdist.sharding.step_time import StepTime
from nbdist.units import duration_ticks, format_count, format_duration, format_parameters
from nbdist.viz.cluster_plan import (MEMORY_COLOURS, TERM_ALIASES, TIME_COLOURS, labelled, time_breakdown_figure,
                                     time_colour, validation_figure)

LAB40 = Path(__file__).resolve().parent.parent / "notebooks" / "40_clusters.ipynb"
A100 = planner.hardware("a100-80gb")


def sweep_figure():
    """Lab 40 cell 'NVLink, InfiniBand or Ethernet': the four curves and the named links, as the lab draws them."""
    model = planner.gpt(layers=80, hidden=12288, heads=96, seq=2048, vocab=51200)
    sweep = [1e9 * 2 ** (k / 2) for k in range(19)]
    curves = {}
    for name, plan in (("3D", dict(tp=8, pp=8, chunks=2)), ("ZeRO-3", dict(tp=8, zero=3, sequence_parallel=True))):
        steps = [planner.predict(model, A100, gpus=1536, global_batch=2304, recompute="full", **plan).step_seconds]
        curves[f"{name} on a100-80gb"] = ([b / 1e9 for b in sweep], steps * len(sweep))
    marks = {"100 GbE per host": 1.5625, "IB HDR": HDR_IB.bandwidth / 1e9, "IB NDR": NDR_IB.bandwidth / 1e9,
             "NVLink 4": NVLINK4.bandwidth / 1e9, "engines here (measured)": 3.0}
    return link_sweep_figure(curves, marks), curves, marks


def test_the_link_sweep_axis_holds_its_curves_and_every_named_link():
    """The axis ran to 10^48 with the curves in its leftmost 5 %: labels of vertical lines on a log axis were
    placed at 10^(GB/s). Now the range is the data's, every mark is a trace inside it, and nothing is an
    annotation plotly would autorange over."""
    fig, curves, marks = sweep_figure()
    low, high = (10 ** v for v in fig.layout.xaxis.range)
    xs = [x for trace in fig.data for x in trace.x]
    data = [x for c, _ in curves.values() for x in c] + list(marks.values())
    assert low <= min(data) and max(data) <= high
    assert math.log10(high / low) <= math.log10(max(data) / min(data)) + 0.2  # no empty decades
    assert all(low <= x <= high for x in xs)
    labels = {t.text[0]: t.x[0] for t in fig.data if t.mode == "text"}
    assert labels == pytest.approx(marks)  # "NVLink 4" on the chart, each label at its own bandwidth
    assert not fig.layout.annotations


def test_a_term_has_one_colour_in_every_figure_and_a_colour_one_meaning():
    """Red meant element-wise, then tensor-parallel all-reduces, then the pipeline bubble in three of lab 40's
    figures. Every term of both predictors has its colour by name; memory parts and step terms share none but the
    optimizer's; the local predictor's names for the same meanings get the same colours."""
    local_terms = re.findall(r'"([^"]+)":', inspect.getsource(StepTime.terms))
    assert "compute" in local_terms
    for term in [*TIME_TERMS, *local_terms]:
        assert term in TIME_COLOURS, term
    meanings: dict[str, set[str]] = {}
    for term, colour in TIME_COLOURS.items():
        meanings.setdefault(colour, set()).add(TERM_ALIASES.get(term, term))
    assert all(len(names) == 1 for names in meanings.values()), meanings
    shared = set(MEMORY_COLOURS.values()) & set(TIME_COLOURS.values())
    assert shared == {MEMORY_COLOURS["optimizer"]}
    p = published.TABLE2[0].predict(A100)
    drawn = [time_breakdown_figure(p.breakdown["time"]),
             scaling_terms_figure([{"label": "ZeRO-3", "gpus": 384, "time": p.breakdown["time"]}], TIME_TERMS)]
    for fig in drawn:
        assert all(trace.marker.color == time_colour(trace.name) for trace in fig.data)
    sources = "\n".join(c.source for c in read_cells(LAB40) if c.cell_type == "code")
    for bars in re.findall(r"go\.Bar\(name=f\"predicted: \{term\}\".*?\)\)", sources, re.S):
        assert "time_colour(term)" in bars  # the lab's own bar charts of terms too


@pytest.mark.parametrize("count, noun, words", [(1, "GPU", "1 GPU"), (2097152, "GPU", "2,097,152 GPUs"),
                                                (1536.0, "GPU", "1,536 GPUs")])
def test_counts_read_as_counts(count, noun, words):
    assert format_count(count, noun) == words


def test_model_sizes_say_parameters_not_bytes():
    """'1008.0 B' read like bytes: a run's label says what it counts."""
    labels = [run.label for run in published.TABLE1 + published.TABLE2 + published.KORTHIKANTI_RUNS]
    assert not [label for label in labels if re.search(r"\d B\b", label)]
    assert format_parameters(1.008e12) == "1.01 trillion parameters"
    assert "parameters" in published.TABLE1[-1].model.describe()


@pytest.mark.parametrize("seconds, words", [(100, "1 min 40 s"), (1110, "18 min 30 s"), (3725, "1 h 2 min"),
                                            (4.56, "4.56 s")])
def test_durations_read_in_whole_units(seconds, words):
    """'1.67 min' and '1.11e+03 s' were printed: minutes and hours now read whole."""
    assert format_duration(seconds) == words


def test_duration_ticks_are_whole_minutes():
    values, labels = duration_ticks(1000)
    assert values[1] == 300 and labels[:3] == ["0 s", "5 min", "10 min"]
    assert all(values[i + 1] - values[i] == values[1] for i in range(len(values) - 1))


def test_lab40_says_gib_where_its_figures_do():
    """'fit in 80 GB' was printed beside an axis marked 80 GiB (the same 2**30-byte unit, hardware.py)."""
    sources = "\n".join(c.source for c in read_cells(LAB40))
    assert "80 GB" not in sources
    assert not re.search(r"\{[a-z_.\[\]']+\} GPUs", sources)  # counts go through format_count
    assert ":.3g} s" not in sources  # durations through format_duration


@pytest.mark.slow
def test_point_labels_of_the_validation_figure_do_not_overlap():
    rows = published.reproduce(published.TABLE1 + published.MT_NLG + published.TABLE2, A100)
    fig = validation_figure(rows)
    span = fig.layout.xaxis.range[1] - fig.layout.xaxis.range[0]
    points = [(x, y) for t in fig.data if t.mode == "markers+text" for x, y, s in zip(t.x, t.y, t.text) if s]
    assert len(points) >= 3
    for i, (x, y) in enumerate(points):
        for x2, y2 in points[i + 1:]:
            assert abs(x - x2) > 0.3 * span or abs(y - y2) > 0.04 * span
    assert len(labelled(rows, span)) == len(points)


def test_planner_controls_wrap_in_a_narrow_notebook():
    """At 1000 px the global-batch box and the FlashAttention checkbox were cut off and the sliders shrank to
    30 px: every row wraps, no control is squeezed, every slider keeps its minimum width."""
    view = ClusterPlannerView()
    rows = view.widget.children[:4]
    assert all(row.layout.flex_flow == "row wrap" for row in rows)
    controls = [c for row in rows for c in row.children]
    assert view.global_batch in controls and view.flash_attention in controls
    sliders = [c for c in controls if type(c).__name__ == "IntSlider"]
    assert len(sliders) == 6 and all(s.layout.min_width == SLIDER_MIN for s in sliders)
    assert int(SLIDER_MIN.removesuffix("px")) >= 200
    assert all(c.layout.flex == "0 0 auto" for c in controls if c not in sliders)
    view.tp.value, view.pp.value, view.dp.value = 1, 1, 1
    assert "1 GPU =" in view.status.value and "1 GPUs" not in view.status.value
