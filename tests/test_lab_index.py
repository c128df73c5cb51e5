"""The labs' index (notebooks/README.md) is kept true: every one of the seed's 30 concepts names a lab, a section of
it that exists, and the figure that shows it; every lab is listed with its run time here, none over 5 minutes."""
from __future__ import annotations

import re
from pathlib import Path

from notebook_files import read_cells

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
INDEX = NOTEBOOKS / "README.md"


def _table(title: str) -> list[list[str]]:
    """The rows of the markdown table under the heading `title` (header and rule left out)."""
    text = INDEX.read_text(encoding="utf-8")
    section = text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row] for row in rows[2:]]


def _headings(lab: str) -> set[str]:
    return {line.lstrip("#").strip() for cell in read_cells(NOTEBOOKS / lab) if cell.cell_type == "markdown"
            for line in cell.source.splitlines() if line.startswith("#")}


def _lab(cell: str) -> str:
    found = re.search(r"\d\d_[\w]+\.ipynb", cell)
    assert found, f"no lab named in {cell!r}"
    return found.group(0)


def test_every_concept_has_a_lab_a_section_that_exists_and_a_figure():
    rows = _table("The seed's 30 concepts")
    numbers = [int(row[0]) for row in rows]
    assert sorted(numbers) == list(range(1, 31)), numbers
    for number, _concept, lab, section, figure in rows:
        lab = _lab(lab)
        assert (NOTEBOOKS / lab).exists(), f"concept {number}: {lab} does not exist"
        section = section.strip("`\"'")
        assert section in _headings(lab), f"concept {number}: {lab} has no section {section!r}"
        assert figure, f"concept {number}: no figure named"


def test_every_lab_is_listed_with_a_run_time_under_five_minutes():
    rows = _table("The labs")
    listed = {_lab(row[0]): row[-1] for row in rows}
    assert set(listed) == {p.name for p in NOTEBOOKS.glob("*.ipynb")}
    for lab, run_time in listed.items():
        seconds = re.fullmatch(r"(\d+) s", run_time)
        assert seconds, f"{lab}: run time {run_time!r} is not 'N s'"
        assert int(seconds.group(1)) <= 300, f"{lab}: {run_time} is over 5 minutes"


def test_the_teachers_page_lists_every_graded_exercise_with_its_points():
    """docs/teachers.md's table of exercises is the labs' own: every graded cell's grade id and points, no other."""
    page = (NOTEBOOKS.parent / "docs" / "teachers.md").read_text(encoding="utf-8")
    listed = dict(re.findall(r"^\|[^|]*\| `([\w-]+)` \| (\d+) \|", page, flags=re.MULTILINE))
    graded = {}
    for path in NOTEBOOKS.glob("*.ipynb"):
        for cell in read_cells(path):
            meta = cell.metadata.get("nbgrader", {})
            if meta.get("grade") and meta.get("solution") is False:
                graded[meta["grade_id"].removesuffix("-test")] = str(meta["points"])
    assert listed == graded
