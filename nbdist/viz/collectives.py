"""Collective benchmarks as plotly figures: busbw against size, and the alpha-beta model against the measurement.

Both are log-log: sizes from a kilobyte to tens of megabytes and times from microseconds to tens of milliseconds
only show their shape on logarithmic axes (a line of slope 1 in time is pure bandwidth, a flat one pure latency).
Colour tells the operation (or the algorithm), dash tells the way: torch.distributed solid, MPI dashed. Drawn from
data only: benchmark rows (dicts) and a fitted model's numbers; the algorithms' names and legends come from the one
cost table (nbdist.cost.collectives, plain data).
"""
from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go

from nbdist.cost import collectives as costs
from nbdist.units import format_bytes

OP_COLOURS = {
    "all_reduce": "#4C78A8",
    "all_gather": "#F58518",
    "reduce_scatter": "#54A24B",
    "broadcast": "#B279A2",
    "all_to_all": "#E45756",
}
VIA_DASH = {"torch": "solid", "mpi": "dash"}
ALGORITHM_STYLES = {  # each name of costs.ALGORITHMS -> (colour, dash); the legend's formula comes from the table
    "ring": ("#4C78A8", "solid"),
    "tree": ("#F58518", "solid"),
    "recursive-doubling": ("#54A24B", "dot"),
}


def busbw_figure(rows: list[dict], title: str | None = None) -> go.Figure:
    """One line per (op, via) through its rows' busbw (GB/s) against size (bytes); rows without a time (an op the
    backend does not support) and zero busbw (one rank: nothing moves) are left out."""
    lines: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        if row.get("busbw"):
            lines.setdefault((row["op"], row["via"]), []).append(row)
    fig = go.Figure([_busbw_trace(op, via, sorted(rs, key=lambda r: r["size_bytes"]))
                     for (op, via), rs in lines.items()])
    sizes = sorted({r["size_bytes"] for rs in lines.values() for r in rs})
    ranks = sorted({r["ranks"] for r in rows})
    fig.update_layout(
        title=title or f"bus bandwidth, {', '.join(map(str, ranks))} ranks (torch solid, MPI dashed)",
        xaxis=_size_axis(sizes),
        yaxis={"title": "busbw (GB/s)", "type": "log"},
        legend={"title": "op, via"},
        margin={"l": 70, "r": 20, "t": 60, "b": 50},
    )
    return fig


def _busbw_trace(op: str, via: str, rows: list[dict]) -> go.Scatter:
    backend = rows[0].get("backend")
    return go.Scatter(
        name=f"{op}, {via}" + (f" ({backend})" if backend else ""),
        x=[r["size_bytes"] for r in rows],
        y=[r["busbw"] for r in rows],
        mode="lines+markers",
        line={"color": OP_COLOURS.get(op, "#777777"), "dash": VIA_DASH.get(via, "dot")},
        hovertext=[f"{op} via {via}, {format_bytes(r['size_bytes'])}: {r['seconds'] * 1e6:.4g} us, "
                   f"algbw {r['algbw']:.3g} GB/s, busbw {r['busbw']:.3g} GB/s" for r in rows],
        hoverinfo="text",
    )


def alpha_beta_figure(fit, n: int, title: str | None = None) -> go.Figure:
    """Seconds against size: the measured points, the fitted α + β·S, and what the ring, the binomial tree and
    recursive doubling would take for an n-rank all-reduce with that α and β; a line where the ring starts to
    beat the tree."""
    sizes = np.geomspace(*_size_range(fit.sizes), 200)
    traces = [go.Scatter(name=f"measured {fit.op} via {fit.via}", x=list(fit.sizes), y=list(fit.seconds),
                         mode="markers", marker={"color": "#333333", "size": 8})]
    traces.append(go.Scatter(name=f"fit: α + βS (α {fit.alpha * 1e6:.3g} us, {fit.bandwidth / 1e9:.3g} GB/s)",
                             x=sizes, y=fit.predict(sizes), mode="lines",
                             line={"color": "#999999", "dash": "dash"}))
    for algorithm in costs.ALGORITHMS:
        colour, dash = ALGORITHM_STYLES[algorithm]
        traces.append(go.Scatter(name=costs.legend(algorithm, n), x=sizes, y=fit.cost(algorithm, sizes, n),
                                 mode="lines", line={"color": colour, "dash": dash}))
    fig = go.Figure(traces)
    crossover = fit.crossover(n)
    if 0 < crossover < math.inf:
        fig.add_vline(x=crossover, line_width=1, line_dash="dot", line_color="#D62728",
                      annotation_text=f"ring beats tree above {format_bytes(crossover)}")
    fig.update_layout(
        title=title or _alpha_beta_title(fit, n, crossover),
        xaxis=_size_axis([]),
        yaxis={"title": "time per operation (s)", "type": "log"},
        legend={"orientation": "h", "yanchor": "top", "y": -0.18, "x": 0},
        margin={"l": 70, "r": 20, "t": 60, "b": 50},
    )
    return fig


def _alpha_beta_title(fit, n: int, crossover: float) -> str:
    if crossover == 0:
        where = "the ring is never slower than the tree"
    elif crossover == math.inf:
        where = "the tree is always faster than the ring"
    else:
        where = f"ring beats tree above {format_bytes(crossover)}"
    return f"alpha-beta model of {fit.op} via {fit.via}; all-reduce on n={n}: {where}"


def _size_range(sizes) -> tuple[float, float]:
    """A little beyond the measured sizes (or 1 KiB to 64 MiB with none)."""
    positive = [s for s in sizes if s > 0]
    if not positive:
        return 2.0**10, 2.0**26
    return min(positive) / 2, max(positive) * 2


def _size_axis(sizes: list[int]) -> dict:
    axis = {"title": "size S (bytes)", "type": "log"}
    if sizes:
        axis.update(tickvals=sizes, ticktext=[format_bytes(s) for s in sizes])
    return axis

