"""Plotly figures for the notebook (kernel side). `show` makes every figure visible live, headless and offline alike;
`figure_html` is the HTML it (and the pipeline view's static copy) uses: plotly.js embedded once per kernel."""
from nbdist.viz.display import figure_html, show

__all__ = ["figure_html", "show"]
