"""A widget shown with a static copy beside it (kernel side).

A live ipywidget draws only in a running JupyterLab; an nbconvert export, or a notebook opened later, keeps only
plain outputs. So every nbdist view displays, right after its widget, its own output with a static HTML copy of
what it draws (hidden in a live JupyterLab), and updates that copy as it redraws: the export shows the final
state. Views subclass this and provide `widget`, `static_html()` and `_static_text()`.
"""
from __future__ import annotations

from IPython.display import display

from nbdist.viz.display import claim_loader, plotly_loader_html

STATIC_COPY = "nbdist-static-copy"
# rendered with the widget: a live JupyterLab / Notebook 7 shows the widget, so its static copy is not shown twice
HIDE_STATIC_COPY = (f"<style>.jp-LabShell .{STATIC_COPY}, .jp-NotebookShell .{STATIC_COPY} "
                    "{display: none !important}</style>")


class WithStaticCopy:
    widget = None
    _static_handle = None

    def static_html(self) -> str:
        raise NotImplementedError

    def _static_text(self) -> str:
        return f"{self!r} (static copy)"

    def _static_bundle(self) -> dict:
        return {"text/html": self.static_html(), "text/plain": self._static_text()}

    def _update_static(self) -> None:
        if self._static_handle is not None:
            self._static_handle.update(self._static_bundle(), raw=True)

    def show(self):
        """Display the widget, then (its own output) the static copy; plotly.js before it if none was emitted."""
        display(self.widget)
        if claim_loader():
            display({"text/html": plotly_loader_html(), "text/plain": "(plotly.js for the figures below)"}, raw=True)
        self._static_handle = display(self._static_bundle(), raw=True, display_id=True)
        return self

    def _ipython_display_(self) -> None:
        self.show()
