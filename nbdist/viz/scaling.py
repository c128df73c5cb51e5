"""A scaling sweep as one figure: per kind of scaling (a column), the measured speed-ups against the ideal and the
fitted law (Amdahl or Gustafson), and below them where each engine count's step time went. Drawn from plain data
only (nbdist.training.scaling.Scaling.panel makes it), so a test or another tool can draw the same thing."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

SPLIT = {"compute_s": ("compute", "#4C78A8"), "comm_s": ("communication", "#F58518"), "idle_s": ("idle", "#BAB0AC"),
         "between_s": ("data, between steps", "#E5E5E5")}
COLOURS = {"measured": "#E45756", "ideal": "#9D9D9D"}
LAW_COLOURS = ("#4C78A8", "#54A24B", "#B279A2")  # one per column: each law its own line in the legend


def scaling_figure(panels: Sequence[Mapping], title: str | None = None) -> go.Figure:
    """One column per panel: {title, engines, speedup, hover, curve: {engines, speedup, name}, split: {compute_s,
    comm_s, idle_s, between_s: seconds per step, one per engine count}}."""
    fig = make_subplots(rows=2, cols=len(panels), vertical_spacing=0.16, horizontal_spacing=0.1,
                        row_heights=[0.62, 0.38], subplot_titles=[p["title"] for p in panels] +
                        ["step time per engine count"] * len(panels))
    for col, panel in enumerate(panels, start=1):
        _speedups(fig, panel, col, first=col == 1)
        _split(fig, panel, col, first=col == 1)
    fig.update_layout(title=title, height=680, barmode="stack", margin={"l": 60, "r": 30, "t": 70, "b": 110},
                      legend={"orientation": "h", "yanchor": "top", "y": -0.1, "x": 0})
    return fig


def _speedups(fig: go.Figure, panel: Mapping, col: int, first: bool) -> None:
    curve = panel["curve"]
    top = max(curve["engines"])
    fig.add_trace(go.Scatter(x=[1, top], y=[1, top], mode="lines", name="ideal: S(n) = n", showlegend=first,
                             legendgroup="ideal", line={"color": COLOURS["ideal"], "dash": "dot"}), 1, col)
    fig.add_trace(go.Scatter(x=curve["engines"], y=curve["speedup"], mode="lines", name=curve["name"],
                             line={"color": LAW_COLOURS[(col - 1) % len(LAW_COLOURS)]}), 1, col)
    fig.add_trace(go.Scatter(x=panel["engines"], y=panel["speedup"], mode="markers+text", name="measured",
                             showlegend=first, legendgroup="measured", hovertext=panel.get("hover"),
                             hoverinfo="text", text=[f"{s:.2f}" for s in panel["speedup"]],
                             textposition="top center", marker={"color": COLOURS["measured"], "size": 10}), 1, col)
    fig.update_xaxes(title_text="engines n", row=1, col=col)
    fig.update_yaxes(title_text="speed-up S(n)", row=1, col=col, rangemode="tozero")


def _split(fig: go.Figure, panel: Mapping, col: int, first: bool) -> None:
    labels = [f"{n} engine{'s' if n > 1 else ''}" for n in panel["engines"]]
    for key, (label, colour) in SPLIT.items():
        values = panel["split"].get(key)
        if values is None:
            continue
        fig.add_trace(go.Bar(x=labels, y=[v * 1e3 for v in values], name=label, marker={"color": colour},
                             showlegend=first, legendgroup=key), 2, col)
    fig.update_yaxes(title_text="ms per step", row=2, col=col)
