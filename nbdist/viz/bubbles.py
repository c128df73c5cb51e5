"""A measured pipeline step's idle time as a stacked bar per rank, one colour per cause (debugging/bubbles.py).

Drawn from the breakdown's data only. Each cause keeps its colour whatever else the step shows, so two steps'
figures read side by side; the title carries the breakdown's sentence (the largest causes and the best change).
"""
from __future__ import annotations

import plotly.graph_objects as go

# cause -> colour (the same names as debugging/bubbles.py's CAUSES, repeated here: drawing imports data only)
COLOURS = {
    "warm-up / cool-down": "#BDBDBD",
    "stage imbalance": "#E45756",
    "transfer": "#9ECAE9",
    "waiting on a late peer": "#F58518",
    "host overhead": "#B279A2",
    "stepping (tick by tick)": "#54A24B",
}


def bubble_figure(breakdown, title: str | None = None) -> go.Figure:
    """One horizontal stacked bar per rank (rank 0 on top): its idle milliseconds by cause."""
    ranks = list(breakdown.idle)
    fig = go.Figure()
    for cause, colour in COLOURS.items():
        values = [breakdown.idle[r].get(cause, 0.0) * 1e3 for r in ranks]
        fig.add_trace(go.Bar(
            y=[f"rank {r}" for r in ranks], x=values, name=cause, orientation="h", marker_color=colour,
            showlegend=any(values),  # a cause this step does not have stays out of the legend
            hovertemplate=f"%{{y}}: {cause} %{{x:.2f}} ms<extra></extra>"))
    heading = title or f"Idle time by cause, step {breakdown.step * 1e3:.1f} ms"
    subtitle = _wrapped(breakdown.sentence())
    lines = subtitle.count("<br>") + 1
    bars = 32 * len(ranks) + 40
    top, bottom = 60 + 16 * lines, 100  # room for the title and its subtitle; for the axis title and the legend
    fig.update_layout(  # title placed as the timeline figure places its own (viz/timeline.py)
        barmode="stack", title={"text": heading, "subtitle": {"text": subtitle}, "yref": "container", "y": 1.0,
                                "yanchor": "top", "pad": {"t": 12}}, xaxis_title="idle (ms)",
        yaxis={"autorange": "reversed"}, height=bars + top + bottom,
        legend={"orientation": "h", "y": -60 / bars, "yanchor": "top", "x": 0}, margin={"t": top, "b": bottom})
    return fig


def _wrapped(text: str, width: int = 110) -> str:
    """The subtitle broken into lines of about `width` characters (plotly does not wrap titles)."""
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + len(word) > width:
            lines.append(line)
            line = ""
        line = f"{line} {word}".strip()
    return "<br>".join([*lines, line])
