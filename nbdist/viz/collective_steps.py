"""An all-reduce step by step, from `nbdist.collectives.trace(...)`: who sends which chunk where, what each rank holds.

Drawn from the trace's data only (its algorithm, ranks, chunk sizes, steps and verdict against dist.all_reduce); the
phases that add come from the one cost table (nbdist.cost.collectives, plain data).

One frame per step, chosen with a slider (or played). Ranks sit on a circle (ring, recursive doubling) or as the
binomial tree (tree). Each message of the step is an arrow labelled with its chunk, orange where the receiver adds
it and blue where it copies it. Beside every rank a row of squares, one per chunk, is shaded by how many ranks'
contributions the chunk holds and shows that count: a full, dark square is reduced. Frames and slider live in the
figure's JSON, so it also renders in a notebook executed headless.
"""
from __future__ import annotations

import itertools
import math

import plotly.graph_objects as go

from nbdist.cost.collectives import REDUCING_PHASES

ADD_COLOUR, COPY_COLOUR = "#F58518", "#4C78A8"
DIFFERS_COLOUR = "#D62728"  # a result that is not dist.all_reduce's
HOLD_SCALE = [[0.0, "#EDEDED"], [1.0, "#2E7D32"]]  # own contribution only -> everyone's
PHASE_NOTES = {
    "reduce-scatter": "each rank adds the chunk from its left neighbour",
    "all-gather": "the reduced chunks travel round the ring, copied",
    "reduce": "partial sums move up the tree and are added",
    "broadcast": "the sum moves down the tree, copied",
    "fold-in": "the ranks beyond the largest power of two hand in their tensor",
    "exchange": "partners (rank XOR 2^k) swap and add their partial sums",
    "fold-out": "the folded-in ranks get the result back",
}
SIZE_PX = 640
AXIS = 1.8  # the data shown is [-AXIS, AXIS] on both axes
NODE_PX = 34
OFFSET = 0.04  # arrows between the same two ranks in opposite directions sit this far apart
LABEL_AT = 0.35  # fraction of the way from sender to receiver
CHUNK_TRACE = 2  # traces: tree links (drawn first, underneath), ranks, chunks (the one that changes per frame)


def collective_steps_figure(trace, title: str | None = None) -> go.Figure:
    """A figure of `trace` (nbdist.collectives.tracing.Trace) with one frame per step and a slider."""
    n, chunks = trace.world_size, len(trace.chunk_sizes)
    nodes = _tree_positions(n) if trace.algorithm == "tree" else _circle_positions(n)
    squares = _chunk_positions(nodes, chunks, beside=trace.algorithm == "tree")
    frames = [
        go.Frame(
            name=str(step["step"]),
            data=[_chunk_trace(squares, step["holds"], n)],
            traces=[CHUNK_TRACE],
            layout={"title": _title(trace, step, title),
                    "annotations": _arrows(nodes, step, chunks) + [_caption(chunks)]},
        )
        for step in trace.steps
    ]
    links = _tree_links(nodes) if trace.algorithm == "tree" else _no_links()
    fig = go.Figure(data=[links, _rank_trace(nodes), frames[0].data[0]], frames=frames)
    fig.update_layout(frames[0].layout)
    _layout(fig, [f.name for f in frames])
    return fig


# -- where things go --------------------------------------------------------------------------------------------


def _circle_positions(n: int) -> list[tuple[float, float]]:
    """Rank 0 at the top, then clockwise: the ring's direction of travel."""
    return [(math.sin(2 * math.pi * r / n), math.cos(2 * math.pi * r / n)) for r in range(n)]


def _tree_positions(n: int) -> list[tuple[float, float]]:
    """The binomial tree of tree_all_reduce: rank r's parent is r with its lowest set bit cleared, so its depth
    is the number of set bits. Leaves are spread left to right in depth-first order, parents above their children."""
    children = {r: [] for r in range(n)}
    for r in range(1, n):
        children[r & (r - 1)].append(r)
    x: dict[int, float] = {}
    leaves = itertools.count()

    def place(r: int) -> None:
        for child in children[r]:
            place(child)
        x[r] = sum(x[c] for c in children[r]) / len(children[r]) if children[r] else next(leaves)

    place(0)
    depth = max(bin(r).count("1") for r in range(n)) or 1
    width = max(x.values()) or 1
    return [(1.4 * (2 * x[r] / width - 1), 1.2 - 2.4 * bin(r).count("1") / depth) for r in range(n)]


def _chunk_positions(nodes: list, chunks: int, beside: bool) -> list[list[tuple[float, float]]]:
    """Per rank, a row of squares: outside the circle (away from the arrows), or right of a tree node."""
    spacing = min(0.13, 5.0 / (len(nodes) * chunks))
    rows = []
    for x, y in nodes:
        if beside:
            start = (x + 0.22, y)
        else:
            centre = (1.35 * x, 1.35 * y)
            start = (centre[0] - spacing * (chunks - 1) / 2, centre[1])
        rows.append([(start[0] + spacing * c, start[1]) for c in range(chunks)])
    return rows


# -- traces and arrows ------------------------------------------------------------------------------------------


def _rank_trace(nodes: list) -> go.Scatter:
    return go.Scatter(
        x=[x for x, _ in nodes],
        y=[y for _, y in nodes],
        mode="markers+text",
        text=[str(r) for r in range(len(nodes))],
        textfont={"size": 14, "color": "#333333"},
        hovertext=[f"rank {r}" for r in range(len(nodes))],
        hoverinfo="text",
        marker={"size": NODE_PX, "color": "white", "line": {"color": "#333333", "width": 2}},
        showlegend=False,
    )


def _tree_links(nodes: list) -> go.Scatter:
    """The tree's parent-child links, faint, under the messages that run along them."""
    xs, ys = [], []
    for r in range(1, len(nodes)):
        parent = nodes[r & (r - 1)]
        xs += [parent[0], nodes[r][0], None]
        ys += [parent[1], nodes[r][1], None]
    return go.Scatter(x=xs, y=ys, mode="lines", line={"color": "#DDDDDD", "width": 6}, hoverinfo="skip",
                      showlegend=False)


def _no_links() -> go.Scatter:
    return go.Scatter(x=[], y=[], mode="lines", hoverinfo="skip", showlegend=False)


def _chunk_trace(squares: list, holds: list[list[list[int]]], n: int) -> go.Scatter:
    """One marker per (rank, chunk), coloured by how many ranks' contributions it holds (1..n)."""
    points = [(rank, c) for rank, row in enumerate(squares) for c in range(len(row))]
    counts = [len(holds[rank][c]) for rank, c in points]
    pixels = _spacing_px(squares)
    return go.Scatter(
        x=[squares[rank][c][0] for rank, c in points],
        y=[squares[rank][c][1] for rank, c in points],
        mode="markers+text",
        text=[str(k) for k in counts],
        textfont={"size": max(7, min(11, int(pixels * 0.6))), "color": ["white" if k == n else "#333333"
                                                                        for k in counts]},
        hovertext=[f"rank {rank}, chunk {c}: sum of ranks {holds[rank][c]}" for rank, c in points],
        hoverinfo="text",
        marker={
            "symbol": "square",
            "size": max(5, pixels - 2),
            "color": counts,
            "cmin": 1,
            "cmax": max(n, 2),
            "colorscale": HOLD_SCALE,
            "line": {"color": "#888888", "width": 1},
            "showscale": True,
            "colorbar": {"title": {"text": "ranks<br>summed"}, "len": 0.5, "thickness": 12, "dtick": 1},
        },
        showlegend=False,
    )


def _spacing_px(squares: list) -> int:
    row = squares[0]
    step = row[1][0] - row[0][0] if len(row) > 1 else 0.13
    return int(step * _px_per_unit())


def _px_per_unit() -> float:
    return (SIZE_PX - 120) / (2 * AXIS)


def _arrows(nodes: list, step: dict, chunks: int) -> list[dict]:
    colour = ADD_COLOUR if step["phase"] in REDUCING_PHASES else COPY_COLOUR
    arrows = []
    for src, dst, chunk in step["sends"]:
        (x0, y0), (x1, y1) = nodes[src], nodes[dst]
        length = math.hypot(x1 - x0, y1 - y0) or 1.0
        nx, ny = -(y1 - y0) / length * OFFSET, (x1 - x0) / length * OFFSET  # to the left of the direction of travel
        arrows.append({
            "x": x1 + nx, "y": y1 + ny, "ax": x0 + nx, "ay": y0 + ny, "xref": "x", "yref": "y", "axref": "x",
            "ayref": "y", "showarrow": True, "arrowhead": 2, "arrowsize": 1.2, "arrowwidth": 2,
            "arrowcolor": colour, "standoff": NODE_PX / 2 + 2, "startstandoff": NODE_PX / 2 + 2, "text": "",
        })
        label_x, label_y = x0 + LABEL_AT * (x1 - x0) + 2.5 * nx, y0 + LABEL_AT * (y1 - y0) + 2.5 * ny
        arrows.append({  # the label a third of the way along: arrows crossing mid-way keep theirs apart
            "x": label_x, "y": label_y, "xref": "x", "yref": "y",
            "showarrow": False, "text": f"c{chunk}" if chunks > 1 else "all", "font": {"color": colour, "size": 12},
            "bgcolor": "rgba(255,255,255,0.8)",
        })
    return arrows


def _caption(chunks: int) -> dict:
    squares = "each rank's chunks c0, c1, ..." if chunks > 1 else "each rank's tensor"
    return {
        "x": 0, "y": -0.02, "xref": "paper", "yref": "paper", "xanchor": "left", "yanchor": "top",
        "showarrow": False, "align": "left", "font": {"size": 11, "color": "#555555"},
        "text": f"<span style='color:{ADD_COLOUR}'>orange</span> arrow: the receiver adds the chunk; "
                f"<span style='color:{COPY_COLOUR}'>blue</span>: it copies it.<br>"
                f"Squares: {squares}, numbered by the ranks summed in it.",
    }


def _title(trace, step: dict, title: str | None) -> str:
    head = title or f"{trace.algorithm} all-reduce, {trace.world_size} ranks"
    note = PHASE_NOTES.get(step["phase"], "")
    colour = "#555555" if trace.matches_library else DIFFERS_COLOUR
    return (f"{head}: step {step['step']} of {len(trace.steps)}, {step['phase']}<br><sup>{note}</sup><br>"
            f"<sup><span style='color:{colour}'>the result {trace.verdict}</span></sup>")


def _layout(fig: go.Figure, names: list[str]) -> None:
    still = {"mode": "immediate", "frame": {"duration": 0, "redraw": True}, "transition": {"duration": 0}}
    play = {"mode": "immediate", "frame": {"duration": 1200, "redraw": True}, "transition": {"duration": 0},
            "fromcurrent": True}
    axis = {"range": [-AXIS, AXIS], "visible": False, "fixedrange": True}
    fig.update_layout(
        width=SIZE_PX,
        height=SIZE_PX + 60,
        margin={"l": 20, "r": 20, "t": 90, "b": 100},
        plot_bgcolor="white",
        xaxis=axis,
        yaxis={**axis, "scaleanchor": "x"},
        sliders=[{
            "active": 0,
            "currentvalue": {"prefix": "step "},
            "pad": {"t": 40},
            "steps": [{"label": name, "method": "animate", "args": [[name], still]} for name in names],
        }],
        updatemenus=[{
            "type": "buttons",
            "showactive": False,
            "x": 0, "y": 0, "xanchor": "right", "yanchor": "top", "pad": {"t": 45, "r": 10},
            "buttons": [{"label": "▶", "method": "animate", "args": [None, play]}],
        }],
    )
