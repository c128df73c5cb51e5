"""A pipeline timeline as a plotly Gantt: one row per rank, one bar per action, gaps where a rank idles.

One horizontal-bar trace per kind of action (not per bar), each bar placed by `base` = start and `x` = duration:
a figure of hundreds of actions stays one handful of traces, fast to draw and to send to the browser. The same
function draws a simulated timeline and a measured one.
"""
from __future__ import annotations

import plotly.graph_objects as go

from nbdist.schedules.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD

# kind -> (legend label, colour). Sends and receives are drawn only for the time they waited ("wait").
STYLES: dict[str, tuple[str, str]] = {
    FORWARD: ("forward F", "#4C78A8"),
    BACKWARD: ("backward B", "#54A24B"),
    BACKWARD_INPUT: ("input grad I", "#F58518"),
    BACKWARD_WEIGHT: ("weight grad W", "#B279A2"),
    "wait": ("waiting for a message", "#C8C8C8"),
}


def timeline_figure(timeline, title: str | None = None, highlight_time: float | None = None) -> go.Figure:
    """Gantt of `timeline` (nbdist.schedules.Timeline), rank 0 on top; `highlight_time` draws a vertical line."""
    rows = {kind: _empty_row() for kind in STYLES}
    for rank, spans in timeline.spans.items():
        for span in spans:
            if span.wait > 0:
                _add_bar(rows["wait"], rank, span, span.start, span.start + span.wait, text="")
            if span.action.is_compute:
                _add_bar(rows[span.action.kind], rank, span, span.start + span.wait, span.end,
                         text=str(span.action.microbatch))
    fig = go.Figure([_trace(kind, row) for kind, row in rows.items() if row["x"]])
    _layout(fig, timeline, title)
    if highlight_time is not None:
        fig.add_vline(x=highlight_time, line_width=2, line_dash="dash", line_color="#D62728")
    return fig


def _empty_row() -> dict[str, list]:
    return {"x": [], "base": [], "y": [], "text": [], "hover": []}


def _add_bar(row: dict[str, list], rank: int, span, start: float, end: float, text: str) -> None:
    """A span's wait (for a message) comes first, then its compute; a send or receive shows only its wait."""
    row["x"].append(end - start)
    row["base"].append(start)
    row["y"].append(_rank_label(rank))
    row["text"].append(text)
    waited = f"  (waited {span.wait:.4g})" if span.wait > 0 else ""
    row["hover"].append(f"{span.action}: {span.start:.4g} to {span.end:.4g}{waited}")


def _trace(kind: str, row: dict[str, list]) -> go.Bar:
    label, colour = STYLES[kind]
    return go.Bar(
        name=label,
        orientation="h",
        x=row["x"],
        base=row["base"],
        y=row["y"],
        text=row["text"],
        textposition="inside",
        insidetextanchor="middle",
        hovertext=row["hover"],
        hoverinfo="text",
        marker={"color": colour, "line": {"color": "white", "width": 1}},
        opacity=0.55 if kind == "wait" else 1.0,
    )


def _rank_label(rank: int) -> str:
    return f"rank {rank}"


def _layout(fig: go.Figure, timeline, title: str | None) -> None:
    if title is None:
        name = timeline.name or "timeline"
        title = f"{name}: makespan {timeline.makespan:.4g}, bubble {timeline.bubble_fraction:.1%}"
    ranks = [_rank_label(r) for r in sorted(timeline.spans)]
    fig.update_layout(
        title=title,
        barmode="overlay",
        bargap=0.25,
        height=120 + 45 * len(ranks),
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
        margin={"l": 70, "r": 20, "t": 80, "b": 50},
        uniformtext={"minsize": 8, "mode": "hide"},
        xaxis={"title": f"time ({timeline.unit})" if timeline.unit else "time", "rangemode": "tozero"},
        yaxis={"categoryorder": "array", "categoryarray": ranks, "autorange": "reversed"},
    )
