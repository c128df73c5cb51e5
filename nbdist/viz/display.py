"""Showing a plotly figure so that it appears wherever the notebook is read.

JupyterLab renders plotly's own mimetype (interactive); a notebook executed headless and exported to HTML (nbconvert,
GitHub) knows only text/html. `show` sends both in one output, and each reader picks what it can render.
"""
from __future__ import annotations

from IPython.display import display


def show(fig, include_plotlyjs: str | bool = "cdn") -> None:
    """Display `fig` as plotly JSON (for JupyterLab) and as HTML (for exported notebooks)."""
    bundle = {
        "application/vnd.plotly.v1+json": fig.to_plotly_json(),
        "text/html": fig.to_html(include_plotlyjs=include_plotlyjs, full_html=False),
        "text/plain": f"<plotly figure: {fig.layout.title.text or 'untitled'}>",
    }
    display(bundle, raw=True)
