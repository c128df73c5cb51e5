"""Whether a fit shows a dashboard, and the dashboard of a fit that waits, opened once the ranks have their work.

Why later: in a kernel, importing the dashboard's widgets and plotly and drawing its first picture takes a
noticeable time (figures: benchmarks/README.md), which the first training step need not wait for. A fit that waits
opens it at the wait's first call, right after the work is sent and in the cell that called fit; a fit in the
background opens it before (its wait runs in another thread, whose output would land in whichever cell runs then)."""
from __future__ import annotations


def shown(always: bool = False) -> bool:
    """A dashboard is drawn in an IPython kernel; outside one (a plain script) only when asked `always` (what a
    benchmark of its cost needs)."""
    if always:
        return True
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return hasattr(get_ipython(), "kernel")


class DashboardOnceSent:
    """Stands for the Dashboard until the wait first calls `progress`, then opens it and passes everything on."""

    def __init__(self, trainer, steps: int):
        self._arguments: tuple | None = (trainer, steps)
        self.view = None

    def progress(self, ar) -> None:
        self._open().progress(ar)

    def close(self, history, summary: bool = True) -> None:
        self._open().close(history, summary)

    def _open(self):
        if self._arguments is not None:
            self.view, self._arguments = open_dashboard(*self._arguments), None
        return self.view


def open_dashboard(trainer, steps: int):
    """The Dashboard of a fit, shown where it can be; its widgets and plotly are imported only here."""
    from nbdist.training.dashboard import Dashboard

    return Dashboard.open(trainer, steps, shown=shown())
