"""Pictures of a plan at cluster scale, drawn from plain data (dicts and lists of numbers): the bytes per GPU by
part against the accelerator's memory, the step's time by term, the frontier of a plan search, and predicted
against published runs. The numbers come from nbdist/planner; nothing is computed here but positions.

For people: each step term keeps one colour whatever other terms appear (TIME_COLOURS, by name), bytes are on
binary axes with binary labels (nbdist.units: the 80 GiB line sits on the axis' "80 GiB"), durations read
"16.8 h", not "6.036e+04 s", and legends sit below the tick labels with no axis title for them to cover (the
unit is in every tick label).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go

from nbdist.units import duration_ticks, format_bytes, format_duration
from nbdist.viz.axes import byte_axis, byte_log_axis

# One colour, one meaning, in every figure of a plan: the memory parts and the step terms share no colour but the
# optimizer's (its bytes and its time), and a term's colour is its own whichever figure draws it (the cluster
# planner's TIME_TERMS and the local predictor's StepTime.terms(), which names some of them its own way).
MEMORY_COLOURS = {"weights": "#6A3D9A", "gradients": "#CAB2D6", "optimizer": "#54A24B", "gathered layers": "#BCBD22",
                  "activations": "#1B9E77", "logits": "#FDB462", "reserved": "#BAB0AC"}
# one colour per step term, by name (nbdist.planner.prediction.TIME_TERMS), whichever terms a plan has
TIME_COLOURS = {"matmul": "#4C78A8", "element-wise": "#72B7B2", "recomputation": "#8CD17D",
                "tensor-parallel all-reduces": "#F58518", "context-parallel k/v ring (exposed)": "#17BECF",
                "ZeRO collectives (exposed)": "#8C564B", "pipeline sends (blocking)": "#FF9DA6",
                "pipeline bubble and messages": "#E45756", "data-parallel sync (exposed)": "#B279A2",
                "all-gather of updated weights": "#9D755D", "tied embedding sync": "#EECA3B",
                "optimizer": MEMORY_COLOURS["optimizer"]}  # the optimizer's time in its memory's colour
# the same meanings as the local predictor names them (nbdist.sharding.step_time.StepTime.terms)
TERM_ALIASES = {"compute": "matmul", "pipeline bubbles and messages": "pipeline bubble and messages",
                "data-parallel sync": "data-parallel sync (exposed)"}
TIME_COLOURS |= {alias: TIME_COLOURS[term] for alias, term in TERM_ALIASES.items()}
TIME_COLOURS |= {"libraries (DTensor, FSDP2)": "#D37295", "ranks sharing the cores": "#7F7F7F"}
OTHER_COLOURS = ("#A0CBE8", "#FFBE7D", "#B6992D", "#499894")  # a term not named above: by a stable hash of its name
LEGEND_BELOW = {"orientation": "h", "yanchor": "top", "y": -0.3, "x": 0}  # under the tick labels, no axis title


def memory_bar_figure(memory: Mapping[str, float], capacity: float, title: str | None = None) -> go.Figure:
    """One horizontal bar of bytes per GPU, a segment per part, and the accelerator's memory as a line."""
    total = sum(memory.values())
    traces = [go.Bar(name=part, y=["per GPU"], x=[value], orientation="h",
                     marker={"color": MEMORY_COLOURS.get(part, "#999999")},
                     hovertext=[f"{part}: {format_bytes(value)}"], hoverinfo="text")
              for part, value in memory.items() if value > 0]
    fig = go.Figure(traces)
    fig.add_vline(x=capacity, line={"color": "#B00020", "dash": "dash"},
                  annotation_text=f"memory {format_bytes(capacity)}", annotation_position="top")
    top = max(total, capacity) * 1.05
    fig.update_layout(
        title=title or f"memory per GPU: {format_bytes(total)} of {format_bytes(capacity)}", barmode="stack",
        height=250, margin={"l": 70, "r": 20, "t": 60, "b": 40}, legend=LEGEND_BELOW,
        xaxis={"range": [0, top], **byte_axis(top)})
    return fig


def time_colour(term: str) -> str:
    """A step term's colour: the same in every figure and at every redraw, whichever other terms are drawn."""
    if term in TIME_COLOURS:
        return TIME_COLOURS[term]
    return OTHER_COLOURS[sum(term.encode()) % len(OTHER_COLOURS)]


def time_breakdown_figure(time: Mapping[str, float], title: str | None = None) -> go.Figure:
    """One horizontal bar of the step's seconds, a segment per term (terms of zero left out)."""
    total = sum(time.values())
    terms = [(name, value) for name, value in time.items() if value > 1e-12]
    traces = [go.Bar(name=name, y=["step"], x=[value], orientation="h", marker={"color": time_colour(name)},
                     hovertext=[f"{name}: {format_duration(value)} ({value / total:.1%})"], hoverinfo="text")
              for name, value in terms]
    fig = go.Figure(traces)
    fig.update_layout(title=title or f"step time: {format_duration(total)}", barmode="stack", height=250,
                      margin={"l": 70, "r": 20, "t": 60, "b": 40}, legend=LEGEND_BELOW,
                      xaxis={"range": [0, total * 1.02], "tickmode": "array",
                             **dict(zip(("tickvals", "ticktext"), duration_ticks(total)))})
    return fig


def frontier_figure(points: Sequence[Mapping], capacity: float, best: Mapping | None = None,
                    title: str | None = None) -> go.Figure:
    """Every candidate plan as a point (bytes per GPU, tokens/s; 'plan', 'fits' in the hover), the frontier (no
    plan uses less memory and runs faster) as a line, the memory limit, and the best plan marked."""
    fig = go.Figure()
    for fits, colour, name in ((True, "#4C78A8", "fits"), (False, "#BAB0AC", "does not fit")):
        chosen = [p for p in points if bool(p["fits"]) == fits]
        fig.add_trace(go.Scattergl(x=[p["memory"] for p in chosen], y=[p["tokens_per_second"] for p in chosen],
                                   mode="markers", name=name, marker={"color": colour, "size": 5},
                                   hovertext=[f"{p['plan']}<br>{format_bytes(p['memory'])}, "
                                              f"{p['tokens_per_second']:,.0f} tokens/s" for p in chosen],
                                   hoverinfo="text"))
    line = pareto(points)
    fig.add_trace(go.Scatter(x=[p["memory"] for p in line], y=[p["tokens_per_second"] for p in line],
                             mode="lines", name="frontier", line={"color": "#54A24B", "shape": "hv"}))
    if best is not None:
        fig.add_trace(go.Scatter(x=[best["memory"]], y=[best["tokens_per_second"]], mode="markers", name="best",
                                 marker={"color": "#111111", "size": 14, "symbol": "star"},
                                 hovertext=[best["plan"]], hoverinfo="text"))
    fig.add_vline(x=capacity, line={"color": "#B00020", "dash": "dash"},
                  annotation_text=f"memory {format_bytes(capacity)}")
    memory = [p["memory"] for p in points] + [capacity]
    fig.update_layout(title=title or "plans: memory per GPU against throughput", height=420,
                      xaxis={"title": "memory per GPU (log)", "type": "log", **byte_log_axis(min(memory), max(memory))},
                      yaxis={"title": "tokens per second", "rangemode": "tozero"},
                      margin={"l": 70, "r": 20, "t": 60, "b": 50})
    return fig


def pareto(points: Sequence[Mapping]) -> list[Mapping]:
    """The plans no other plan beats on both memory (less) and throughput (more), by increasing memory."""
    line, fastest = [], float("-inf")
    for p in sorted(points, key=lambda p: (p["memory"], -p["tokens_per_second"])):
        if p["tokens_per_second"] > fastest:
            line.append(p)
            fastest = p["tokens_per_second"]
    return line


def validation_figure(rows: Sequence[Mapping], tolerance: float = 0.15, title: str | None = None) -> go.Figure:
    """Predicted against published TFLOP/s per GPU, one point per run ('run', 'source', 'predicted',
    'published'), the line where they agree and the ±tolerance band."""
    low = min(min(r["predicted"], r["published"]) for r in rows) * 0.8
    high = max(max(r["predicted"], r["published"]) for r in rows) * 1.1
    fig = go.Figure()
    for sign in (1 + tolerance, 1 - tolerance):
        fig.add_trace(go.Scatter(x=[low, high], y=[low * sign, high * sign], mode="lines", showlegend=False,
                                 line={"color": "#BAB0AC", "dash": "dot"}, hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=[low, high], y=[low, high], mode="lines", name="predicted = published",
                             line={"color": "#79706E"}))
    shown = labelled(rows, high - low)
    for source in dict.fromkeys(r["source"] for r in rows):
        chosen = [r for r in rows if r["source"] == source]
        fig.add_trace(go.Scatter(x=[r["published"] for r in chosen], y=[r["predicted"] for r in chosen],
                                 mode="markers+text", name=source,
                                 text=[r["run"] if id(r) in shown else "" for r in chosen],
                                 textposition="middle right", textfont={"size": 9},
                                 hovertext=[f"{r['run']}: predicted {r['predicted']:.0f}, published "
                                            f"{r['published']:.0f} ({r['predicted'] / r['published'] - 1:+.0%})"
                                            for r in chosen], hoverinfo="text"))
    fig.update_layout(title=title or f"TFLOP/s per GPU: predicted against published (dotted: ±{tolerance:.0%})",
                      height=480, xaxis={"title": "published TFLOP/s per GPU", "range": [low, high]},
                      yaxis={"title": "predicted TFLOP/s per GPU", "range": [low, high]},
                      legend={"orientation": "h", "y": -0.2}, margin={"l": 70, "r": 20, "t": 60, "b": 60})
    return fig


def labelled(rows: Sequence[Mapping], span: float, wide: float = 0.3, tall: float = 0.04) -> set[int]:
    """The ids of the rows whose point gets a text label (drawn to the point's right, about `wide` of the axis
    `span` long and `tall` of it high): a point whose label would run into one already kept keeps only its hover
    text, so no two labels are drawn over each other."""
    kept: list[Mapping] = []
    for r in sorted(rows, key=lambda r: (r["published"], r["predicted"])):
        if all(abs(r["published"] - k["published"]) > wide * span or abs(r["predicted"] - k["predicted"])
               > tall * span for k in kept):
            kept.append(r)
    return {id(r) for r in kept}
