"""Plotly figures for the notebook (kernel side). `show` makes every figure visible live and headless alike."""
from nbdist.viz.display import show

__all__ = ["show"]
