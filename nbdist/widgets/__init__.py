"""ipywidgets over nbdist.viz: live views that fall back to static figures when nothing renders widgets."""
