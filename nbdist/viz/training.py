"""A training run as one figure: loss (train and evaluation), throughput, and per rank the split of step time
into compute, communication and idle, with each rank's utilisation and memory. Drawn from plain data only: the
History's records and the ranks' latest telemetry (dicts), so the live dashboard, the static copy in an exported
notebook and a test draw the same thing.

People's units: the split bars are each rank's mean step in ms over the newest steps (a step's time, not a sum of
20 of them), memory is in binary units with binary labels (nbdist.units), and a panel with nothing to draw yet says
why instead of showing empty axes."""
from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from nbdist.viz.axes import byte_axis

SPLIT = {"compute_s": ("compute", "#4C78A8"), "comm_s": ("communication", "#F58518"), "idle_s": ("idle", "#BAB0AC")}
RECENT_STEPS = 20  # the split bars show the newest steps (what the run does now, not its warm-up)
SPLIT_TITLE = f"each rank's step time<br>(mean of the last {RECENT_STEPS} steps)"  # two short lines: side by side
# with the next panel's title at 1000 px (JupyterLab with its file browser open), one line ran into it
NO_SAMPLE = "no utilisation sample yet:<br>the ranks send one every<br>half second while they train"


def trace_values(records: Sequence[Mapping], telemetry: Mapping[int, Mapping] | None = None) -> list[dict]:
    """The x and y of every trace of training_figure, in its order: what changes from one redraw to the next (a
    live view patches these into the figure it drew first instead of building the figure again)."""
    telemetry = telemetry or {}
    steps = [r["step"] for r in records]
    values = [{"x": steps, "y": [r["loss"] for r in records]}]
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        values.append({"x": [r["step"] for r in evals], "y": [r["eval_loss"] for r in evals]})
    values.append({"x": steps, "y": [r["samples"] / r["seconds"] if r["seconds"] else None for r in records]})
    recent = records[-RECENT_STEPS:]
    ranks = sorted({rank for r in recent for rank in r["ranks"]})
    for key in SPLIT:
        values.append({"x": [f"rank {rank}" for rank in ranks], "y": [_mean_ms(recent, rank, key) for rank in ranks]})
    measured = sorted(telemetry)
    gpu = _on_gpu(telemetry)
    for key in (("gpu_percent", "gpu_memory_bytes") if gpu else ("cpu_percent", "rss_bytes")):
        values.append({"x": [f"rank {rank}" for rank in measured],
                       "y": [telemetry[rank].get(key, 0) for rank in measured]})
    return values


def _mean_ms(records: Sequence[Mapping], rank: int, key: str) -> float:
    """One rank's mean of `key` (seconds) over the records it is in, in ms: the time of one step."""
    times = [r["ranks"][rank][key] for r in records if rank in r["ranks"]]
    return 1e3 * sum(times) / len(times) if times else 0.0


def memory_axis(telemetry: Mapping[int, Mapping] | None) -> dict:
    """The memory axis' ticks (binary units, binary labels) for the ranks' latest telemetry: a live view patches
    these into its figure's layout with the traces' values."""
    telemetry = telemetry or {}
    key = "gpu_memory_bytes" if _on_gpu(telemetry) else "rss_bytes"
    return byte_axis(max((t.get(key) or 0 for t in telemetry.values()), default=0))


def utilisation_note(telemetry: Mapping[int, Mapping] | None) -> list[dict]:
    """The utilisation panel's annotation while no rank has sent telemetry (a run shorter than one sample): the
    panel says why it is empty instead of showing bare axes."""
    if telemetry:
        return []
    return [{"text": NO_SAMPLE, "xref": "x4 domain", "yref": "y4 domain", "x": 0.5, "y": 0.5, "showarrow": False,
             "font": {"size": 12, "color": "#555555"}, "name": "no-telemetry"}]


def utilisation_axes(telemetry: Mapping[int, Mapping] | None) -> dict:
    """The utilisation panel's axes as a layout patch: hidden while there is no sample (the note says why), the
    memory axis in binary units otherwise."""
    shown = bool(telemetry)
    return {"xaxis4": {"visible": shown}, "yaxis4": {"visible": shown},
            "yaxis5": {"visible": shown, **memory_axis(telemetry)}}


def shape_of(records: Sequence[Mapping], telemetry: Mapping[int, Mapping] | None = None) -> tuple:
    """What decides the figure's traces and axes (not their values): a live view redraws in full when it changes."""
    return any("eval_loss" in r for r in records), _on_gpu(telemetry or {})


def _on_gpu(telemetry: Mapping[int, Mapping]) -> bool:
    return any("gpu_percent" in t for t in telemetry.values())


def training_figure(records: Sequence[Mapping], telemetry: Mapping[int, Mapping] | None = None,
                    title: str | None = None, subtitle: str | None = None) -> go.Figure:
    fig = make_subplots(rows=2, cols=2, horizontal_spacing=0.12, vertical_spacing=0.25, subplot_titles=(
        "loss", "samples / s", SPLIT_TITLE, "each rank:<br>utilisation, memory"),
        specs=[[{}, {}], [{}, {"secondary_y": True}]])
    values = iter(trace_values(records, telemetry))
    fig.add_trace(go.Scatter(**next(values), name="train loss", mode="lines", line={"color": "#4C78A8"}), 1, 1)
    if shape_of(records)[0]:
        fig.add_trace(go.Scatter(**next(values), name="eval loss", mode="lines+markers", line={"color": "#E45756"}),
                      1, 1)
    fig.add_trace(go.Scatter(**next(values), name="samples/s", mode="lines", line={"color": "#54A24B"},
                             showlegend=False), 1, 2)
    for label, colour in SPLIT.values():
        fig.add_trace(go.Bar(**next(values), name=label, marker={"color": colour}), 2, 1)
    gpu = _on_gpu(telemetry or {})
    fig.add_trace(go.Bar(**next(values), name="GPU %" if gpu else "CPU % (of one core)", offsetgroup="busy",
                         marker={"color": "#72B7B2"}), 2, 2, secondary_y=False)
    fig.add_trace(go.Bar(**next(values), name="GPU memory" if gpu else "resident memory", offsetgroup="held",
                         marker={"color": "#B279A2"}), 2, 2, secondary_y=True)
    fig.update_yaxes(title_text="%", row=2, col=2, secondary_y=False, rangemode="tozero")
    fig.update_yaxes(title_text="memory", row=2, col=2, secondary_y=True, **memory_axis(telemetry))
    fig.update_layout(title={"text": title, "subtitle": {"text": subtitle}}, height=640, barmode="stack",
                      margin={"l": 60, "r": 70, "t": 90, "b": 90},
                      legend={"orientation": "h", "yref": "container", "yanchor": "bottom", "y": 0, "x": 0})
    # the legend at the figure's foot, under the margin the bar charts' rank labels take: placed in the plot's
    # coordinates (y -0.1) it moved with the plot's height and covered those labels at 1600 px
    fig.update_annotations(font={"size": 14})  # the panels' titles
    for note in utilisation_note(telemetry):
        fig.add_annotation(**{k: v for k, v in note.items() if k != "name"}, name=note["name"])
    fig.update_layout(utilisation_axes(telemetry))
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_xaxes(title_text="step", row=1, col=2)
    fig.update_yaxes(title_text="ms per step", row=2, col=1)
    return fig
