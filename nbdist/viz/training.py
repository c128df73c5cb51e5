"""A training run as one figure: loss (train and evaluation), throughput, and per rank the split of step time
into compute, communication and idle, with each rank's utilisation and memory. Drawn from plain data only: the
History's records and the ranks' latest telemetry (dicts), so the live dashboard, the static copy in an exported
notebook and a test draw the same thing."""
from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

SPLIT = {"compute_s": ("compute", "#4C78A8"), "comm_s": ("communication", "#F58518"), "idle_s": ("idle", "#BAB0AC")}
RECENT_STEPS = 20  # the split bars show the newest steps (what the run does now, not its warm-up)


def training_figure(records: Sequence[Mapping], telemetry: Mapping[int, Mapping] | None = None,
                    title: str | None = None) -> go.Figure:
    fig = make_subplots(rows=2, cols=2, horizontal_spacing=0.12, vertical_spacing=0.18, subplot_titles=(
        "loss", "samples / s", f"each rank's step time, last {RECENT_STEPS} steps", "each rank: utilisation, memory"),
        specs=[[{}, {}], [{}, {"secondary_y": True}]])
    steps = [r["step"] for r in records]
    fig.add_trace(go.Scatter(x=steps, y=[r["loss"] for r in records], name="train loss", mode="lines",
                             line={"color": "#4C78A8"}), 1, 1)
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        fig.add_trace(go.Scatter(x=[r["step"] for r in evals], y=[r["eval_loss"] for r in evals],
                                 name="eval loss", mode="lines+markers", line={"color": "#E45756"}), 1, 1)
    fig.add_trace(go.Scatter(x=steps, y=[r["samples"] / r["seconds"] if r["seconds"] else None for r in records],
                             name="samples/s", mode="lines", line={"color": "#54A24B"}, showlegend=False), 1, 2)
    _split_bars(fig, records[-RECENT_STEPS:])
    _utilisation(fig, telemetry or {})
    fig.update_layout(title=title, height=600, barmode="stack", margin={"l": 60, "r": 60, "t": 70, "b": 90},
                      legend={"orientation": "h", "yanchor": "top", "y": -0.1, "x": 0})
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_xaxes(title_text="step", row=1, col=2)
    fig.update_yaxes(title_text="seconds", row=2, col=1)
    return fig


def _split_bars(fig: go.Figure, records: Sequence[Mapping]) -> None:
    ranks = sorted({rank for r in records for rank in r["ranks"]})
    labels = [f"rank {rank}" for rank in ranks]
    for key, (label, colour) in SPLIT.items():
        values = [sum(r["ranks"][rank][key] for r in records if rank in r["ranks"]) for rank in ranks]
        fig.add_trace(go.Bar(x=labels, y=values, name=label, marker={"color": colour}), 2, 1)


def _utilisation(fig: go.Figure, telemetry: Mapping[int, Mapping]) -> None:
    ranks = sorted(telemetry)
    labels = [f"rank {rank}" for rank in ranks]
    gpu = any("gpu_percent" in telemetry[r] for r in ranks)
    busy = [telemetry[r].get("gpu_percent" if gpu else "cpu_percent", 0.0) for r in ranks]
    held = [telemetry[r].get("gpu_memory_bytes" if gpu else "rss_bytes", 0) for r in ranks]
    fig.add_trace(go.Bar(x=labels, y=busy, name="GPU %" if gpu else "CPU % (of one core)", offsetgroup="busy",
                         marker={"color": "#72B7B2"}), 2, 2, secondary_y=False)
    fig.add_trace(go.Bar(x=labels, y=held, name="GPU memory" if gpu else "resident memory", offsetgroup="held",
                         marker={"color": "#B279A2"}), 2, 2, secondary_y=True)
    fig.update_yaxes(title_text="%", row=2, col=2, secondary_y=False)
    fig.update_yaxes(title_text="bytes", tickformat="~s", row=2, col=2, secondary_y=True)
