"""Notebooks read as the JSON they are (format 4, as the repository keeps them), for the tests that read their cells:
nbformat's reader validates against its schema, and importing it alone costs over a second here (jsonschema's
format checkers), which the fast tests should not pay."""
from __future__ import annotations

import json
from pathlib import Path


class Cell(dict):
    """A cell as nbformat gives it: keys as attributes, the source as one string."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def read_cells(path: Path) -> list[Cell]:
    notebook = json.loads(Path(path).read_text(encoding="utf-8"))
    assert notebook["nbformat"] == 4, f"{path}: notebook format {notebook['nbformat']}, not 4"
    cells = []
    for cell in notebook["cells"]:
        source = cell.get("source", "")
        cells.append(Cell(cell, source=source if isinstance(source, str) else "".join(source)))
    return cells
