"""A mesh as a picture: one cell per rank, pipeline stages as rows, coloured by data-parallel replica.

Drawn from the Mesh's data only (nbdist.mesh.Mesh): rows are the pp coordinate (one row if there is no pp), columns
every combination of the other coordinates, outermost first, so a tensor-parallel group sits side by side in a row
and a replica's pipeline runs down a column.
"""
from __future__ import annotations

from itertools import product

import plotly.graph_objects as go

CELL_FONT_SIZE = 11  # a fixed size: plotly's default ("auto") shrinks a cell's text to ~5 px in a narrow figure
# one colour per replica, none of them a colour another figure gives a meaning: the plan explorer draws this picture
# beside its memory chart, whose parameters, gradients, optimizer state and activations are blue, orange, green
# and purple (viz/plan.py MEMORY_PARTS); the replicas were those same four colours
REPLICA_COLOURS = ["#EECA3B", "#9CDED6", "#C9B18B", "#D3D3D3", "#9D755D", "#E7E1A8", "#A0A0A0", "#F2B8C6"]


def mesh_figure(mesh, title: str | None = None) -> go.Figure:
    rows_dim = "pp" if "pp" in mesh.names else None
    column_dims = [(name, size) for name, size in mesh.dims if name != rows_dim]
    colour_dim = "dp" if "dp" in mesh.names else (column_dims[0][0] if column_dims else None)
    columns = list(product(*(range(size) for _, size in column_dims)))
    n_rows = mesh.dim_size(rows_dim) if rows_dim else 1
    z, text, hover = [], [], []
    for row in range(n_rows):
        z.append([]), text.append([]), hover.append([])
        for column in columns:
            coords = dict(zip((name for name, _ in column_dims), column))
            if rows_dim:
                coords[rows_dim] = row
            rank = mesh.rank_at(**coords)
            z[-1].append(coords[colour_dim] if colour_dim else 0)
            text[-1].append(f"rank {rank}<br>" + " · ".join(f"{k} {coords[k]}" for k in mesh.names))
            hover[-1].append(f"rank {rank}: " + ", ".join(f"{k}={coords[k]}" for k in mesh.names))
    colours = max(1, mesh.dim_size(colour_dim) if colour_dim else 1)
    fig = go.Figure(go.Heatmap(
        z=z, text=text, texttemplate="%{text}", textfont={"size": CELL_FONT_SIZE}, hovertext=hover, hoverinfo="text",
        showscale=False,
        colorscale=_discrete(colours), zmin=-0.5, zmax=colours - 0.5, xgap=4, ygap=4,
    ))
    fig.update_layout(
        title=title or _title(mesh, colour_dim),
        width=max(320, 140 * len(columns) + 120),
        height=max(200, 90 * n_rows + 120),
        margin={"l": 80, "r": 20, "t": 60, "b": 40},
        xaxis={"showticklabels": False, "showgrid": False, "zeroline": False},
        yaxis={"autorange": "reversed", "tickvals": list(range(n_rows)), "showgrid": False, "zeroline": False,
               "ticktext": [f"stage {r}" if rows_dim else "" for r in range(n_rows)]},
    )
    return fig


def _title(mesh, colour_dim: str | None) -> str:
    shape = " × ".join(f"{name}={size}" for name, size in mesh.dims)
    colour = f", colour: {colour_dim} coordinate" if colour_dim else ""
    return f"mesh {shape}: one cell per rank{colour}"


def _discrete(n: int) -> list:
    """A colourscale with n flat bands, one colour per coordinate 0..n-1."""
    scale = []
    for i in range(n):
        colour = REPLICA_COLOURS[i % len(REPLICA_COLOURS)]
        scale += [[i / n, colour], [(i + 1) / n, colour]]
    return scale
