"""Every lab keeps the conventions its student version and its teacher rely on (no kernel runs):

- predict, then run, then explain: each lab asks for at least one prediction in a cell of its own, left unset
  (`name = ...  # your prediction: ...`), measures it in a later cell, and only then compares the two with
  `nbdist.verdicts.compare("...", name, ...)`;
- graded exercises in nbgrader's form: solution cells (unlocked, a BEGIN/END SOLUTION region) and locked test
  cells with 1-3 points and an `assert`, their grade ids starting with the lab's number;
- nothing outside an exercise uses a name its solution defines: the student version runs with the solutions
  stubbed, and every cell outside the exercises must still run;
- no outputs are stored in the repository's notebooks.

tests/test_nbgrader.py checks what nbgrader itself does with these cells (ids unique across labs, the student
versions made and run); the labs' claims are checked in tests/test_lab_claims_*.py.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from notebook_files import read_cells

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
PREDICTION = re.compile(r"^(\w+) = \.\.\.  # your prediction: ", re.M)


def cells(lab: Path) -> list:
    return read_cells(lab)


def grading(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


@pytest.mark.parametrize("lab", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_prediction_is_unset_then_measured_then_compared(lab):
    code = [c.source for c in cells(lab) if c.cell_type == "code"]
    asked = [(i, m.group(1)) for i, source in enumerate(code) for m in PREDICTION.finditer(source)]
    names = [name for _, name in asked]
    assert names, f"{lab.name} asks for no prediction"
    assert len(set(names)) == len(names), f"{lab.name}: a prediction's name is used twice: {names}"
    assert all(name.startswith("predicted_") for name in names), names
    for i, name in asked:
        compared = [j for j, source in enumerate(code) if j > i and "compare(" in source
                    and re.search(rf"compare\(.*?,\s*{name}\s*,", source, re.S)]
        assert compared and compared[0] > i + 1, f"{lab.name}: {name} is not measured, then compared, after it is asked"


@pytest.mark.parametrize("lab", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_lab_has_a_graded_exercise_in_nbgraders_form(lab):
    every = cells(lab)
    solutions = [c for c in every if grading(c).get("solution")]
    tests = [c for c in every if grading(c).get("grade") and not grading(c).get("solution")]
    assert solutions and tests, f"{lab.name} has no graded exercise"
    number = lab.name[:2]
    for cell in solutions:
        meta = grading(cell)
        assert meta["grade_id"].startswith(f"{number}-") and not meta["locked"], meta
        assert "### BEGIN SOLUTION" in cell.source and "### END SOLUTION" in cell.source, meta["grade_id"]
    for cell in tests:
        meta = grading(cell)
        assert meta["grade_id"].startswith(f"{number}-") and meta["locked"] and 1 <= meta["points"] <= 3, meta
        assert "assert" in cell.source, meta["grade_id"]


@pytest.mark.parametrize("lab", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_nothing_outside_an_exercise_uses_what_a_solution_defines(lab):
    every = cells(lab)
    defined = set()
    for cell in every:
        if grading(cell).get("solution"):
            for node in ast.parse(cell.source).body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    defined.add(node.name)
                elif isinstance(node, ast.Assign):
                    defined |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    assert defined, f"{lab.name}: its solutions define nothing a test could check"
    for cell in every:
        if cell.cell_type != "code" or grading(cell):
            continue
        used = {n.id for n in ast.walk(ast.parse(_without_magics(cell.source))) if isinstance(n, ast.Name)}
        named = {name for name in defined if re.search(rf"(?<![\w.]){name}\b", cell.source)}  # in a string too
        outside = (used | named) & defined
        assert not outside, f"{lab.name}: a cell outside the exercises uses {sorted(outside)}"


@pytest.mark.parametrize("lab", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_outputs_are_stored(lab):
    assert not [c for c in cells(lab) if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count"))]


def _without_magics(source: str) -> str:
    """A cell's Python: its IPython magics (`%dist_start`, `%%dist`) blanked out."""
    lines = source.splitlines()
    if lines and lines[0].startswith("%%"):
        return ""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)
