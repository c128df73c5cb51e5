"""ipywidgets over nbdist.viz: live views (figures redrawn in place, figure.py) with a static copy beside them for
readers without widgets (pipeline_view.py)."""
