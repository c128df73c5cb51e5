"""Figures of lab 40 drawn from the planner's numbers (plain lists and dicts in, a plotly figure out), so that what a
reader sees can be checked without a browser: the step against the bandwidth between hosts, and ZeRO-3 against
PTD-P as GPUs are added.

Log axes are given their range (plotly autoranges over every annotation, and an annotation on a log axis takes
log10 of its position: a label written at x = 25 GB/s lands at 10^25); vertical marks are traces, labelled where
they stand, and the range covers every curve and every mark. Colours: a step term keeps its colour from
nbdist.viz.cluster_plan.TIME_COLOURS; plans and links have their own (PLAN_COLOURS), none of them a term's.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import plotly.graph_objects as go

from nbdist.units import format_count
from nbdist.viz.cluster_plan import LEGEND_BELOW, time_colour

PLAN_COLOURS = {"3D": "#2F4B7C", "ZeRO-3": "#8C564B", "PTD-P": "#2F4B7C"}  # ZeRO-3: the colour of its collectives
MARK_COLOUR = "#79706E"  # a named link, dashed
HERE_COLOUR = "#333333"  # this machine, measured


def log_range(values: Sequence[float], margin: float = 0.05) -> list[float]:
    """A plotly log-axis range (log10 units) that holds every positive value, with `margin` decades either side."""
    logs = [math.log10(v) for v in values if v > 0]
    return [min(logs) - margin, max(logs) + margin]


def link_sweep_figure(curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], marks: Mapping[str, float],
                      dashes: Mapping[str, str] | None = None, title: str = "") -> go.Figure:
    """Seconds per step (y) against bytes/s per GPU across hosts (x), one curve per name (`curves`: name -> (x in
    GB/s, y in s)); each of `marks` (name -> GB/s) a dashed vertical line labelled at its top. The x range covers
    the curves and the marks; y the curves."""
    fig = go.Figure()
    for name, (x, y) in curves.items():
        plan = name.split(" on ")[0]
        fig.add_trace(go.Scatter(x=list(x), y=list(y), mode="lines", name=name,
                                 line={"color": PLAN_COLOURS.get(plan, HERE_COLOUR),
                                       "dash": (dashes or {}).get(name, "solid")}))
    ys = [v for _, y in curves.values() for v in y]
    low, high = min(ys), max(ys)
    for k, (name, bandwidth) in enumerate(marks.items()):
        colour = HERE_COLOUR if "here" in name else MARK_COLOUR
        fig.add_trace(go.Scatter(x=[bandwidth, bandwidth], y=[low, high], mode="lines", showlegend=False,
                                 line={"color": colour, "dash": "dash", "width": 1}, hoverinfo="skip"))
        at = high if k % 2 == 0 else low  # alternate top and bottom: neighbouring marks' labels do not collide
        fig.add_trace(go.Scatter(x=[bandwidth], y=[at], mode="text", text=[name], showlegend=False,
                                 textposition="top center" if k % 2 == 0 else "bottom center",
                                 textfont={"size": 10, "color": colour}, hoverinfo="skip", cliponaxis=False))
    xs = [v for x, _ in curves.values() for v in x] + list(marks.values())
    fig.update_layout(title=title, height=480, legend=LEGEND_BELOW, margin={"l": 70, "r": 20, "t": 70, "b": 60},
                      xaxis={"title": "bandwidth across hosts, GB/s per GPU each way (log)", "type": "log",
                             "range": log_range(xs)},
                      yaxis={"title": "seconds per step (log)", "type": "log", "range": log_range([low, high], 0.15)})
    return fig


def scaling_terms_figure(rows: Sequence[Mapping], terms: Sequence[str], title: str = "") -> go.Figure:
    """Per run ('label', 'gpus', 'time': seconds per step by term), a stacked bar of its step by term: where the
    step goes as GPUs are added. Terms keep their colours of every other figure (TIME_COLOURS)."""
    fig = go.Figure()
    x = [f"{r['label']}, {format_count(r['gpus'], 'GPU')}" for r in rows]
    for term in terms:
        values = [r["time"].get(term, 0.0) for r in rows]
        if any(v > 0 for v in values):
            fig.add_trace(go.Bar(name=term, x=x, y=values, marker={"color": time_colour(term)},
                                 hovertext=[f"{term}: {v:.1f} s" for v in values], hoverinfo="text"))
    fig.update_layout(title=title, barmode="stack", height=460, yaxis={"title": "seconds per step"},
                      legend=LEGEND_BELOW, margin={"l": 70, "r": 20, "t": 60, "b": 60})
    return fig
