"""A view whose controls replan on every change (kernel side): several moved at once plan once.

`choose(**values)` sets the named controls with their change handlers quiet, lets the view adjust what follows from
them (`_chosen`), then replans once; `quietly()` is how a view moves its own controls without replanning.
"""
from __future__ import annotations

import contextlib

from nbdist.errors import DistUsageError


class Controls:
    CONTROLS: tuple[str, ...] = ()  # the names of the view's control widgets (its attributes)
    NAME = "the view"  # as a refusal names it
    _quiet = False

    @contextlib.contextmanager
    def quietly(self):
        """Move controls without replanning at each change (their handlers check `_quiet`)."""
        self._quiet = True
        try:
            yield
        finally:
            self._quiet = False

    def choose(self, **values):
        """Set several controls at once (names in CONTROLS) and plan once, as if they had been moved together."""
        unknown = sorted(set(values) - set(self.CONTROLS))
        if unknown:
            raise DistUsageError(f"{self.NAME} has no control {', '.join(unknown)}")
        with self.quietly():
            for name, value in values.items():
                getattr(self, name).value = value
            self._chosen(values)
        self._replan()
        return self

    def _chosen(self, values: dict) -> None:
        """What follows from the chosen values, set quietly before the one replan (nothing by default)."""

    def _replan(self) -> None:
        raise NotImplementedError
