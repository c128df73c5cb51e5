"""The labs' graded exercises survive nbgrader's round trip: a teacher can hand them out and grade them.

Every notebook in notebooks/ with nbgrader cells (found by their metadata, so a lab that gains exercises is picked
up) is put in one course directory, `source/<lab>/<lab>.ipynb`, and nbgrader's own `generate_assignment` makes the
student versions of all of them at once (no kernel runs: the fast subset checks them). Then:

(a) the student version has no solution left (every BEGIN/END SOLUTION region is nbgrader's stub, hidden tests are
    gone) and every other cell is the teacher's, unchanged;
(b) the teacher's version passes its own tests: the teacher's source, submitted as a student's and graded by
    nbgrader's `autograde`, gets full points in the gradebook;
(c) the student version runs top to bottom with the solutions stubbed: autograded, it fails only in solution cells
    and test cells, every other cell runs without an error, and every test cell scores below its points (the tests
    really test).

What each check costs. (a) runs no kernel. (c) is one more run of each graded lab (1-5 minutes each), which nothing
else does. (b) would be another: instead, every lab's source already runs top to bottom in tests/test_notebooks.py,
which fails on any error, so there every test cell's asserts pass with the teacher's solutions; here nbgrader grades
the teacher's source only of TEACHER_LABS (the quick start: half a minute), to prove the teacher's path through
nbgrader itself (its execution, its gradebook). NBDIST_NBGRADER_TEACHER=all grades every graded lab's source too.
(c) runs on STUDENT_LABS, the labs that differ in kind (seven minutes for all 17, under two for these): every lab's
exercises are the same kind of cell (a kernel-side solution, a locked test after it), and what makes (c) pass for a
lab, that nothing outside an exercise uses what a solution defines, is checked on every lab without a kernel
(tests/test_lab_conventions.py); the labs that differ are the quick start (magics, a cluster started by
`%dist_start`), a lab with two exercises (the pipeline lab: the stepper) and the lab that needs hosts from its
environment (many hosts). NBDIST_NBGRADER_STUDENT=all runs every graded lab's student version.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from notebook_files import read_cells
from test_notebooks import _hosts_for

if TYPE_CHECKING:
    import nbformat

REPO = Path(__file__).resolve().parent.parent
CELL_TIMEOUT_S = 900  # a lab cell may start an MPI cluster or time several pipeline steps: minutes, not nbgrader's 30 s
TEACHER_LABS = {"00_quickstart"}
STUDENT_LABS = {"00_quickstart", "10_pipeline_lab", "41_many_hosts"}
pytestmark = pytest.mark.filterwarnings("ignore:Object of type <Submitted")  # nbgrader's own SQLAlchemy use
STUB = "# YOUR CODE HERE\nraise NotImplementedError()"  # nbgrader's default code stub (ClearSolutions.code_stub)
SOLUTION_REGION = re.compile(r"^([ \t]*)### BEGIN SOLUTION[^\n]*\n.*?^[ \t]*### END SOLUTION[^\n]*$", re.S | re.M)


def nbgrader_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def is_solution(cell) -> bool:
    return bool(nbgrader_meta(cell).get("solution"))


def is_test(cell) -> bool:
    meta = nbgrader_meta(cell)
    return bool(meta.get("grade")) and not meta.get("solution")


def graded_labs() -> list[Path]:
    """The notebooks with at least one nbgrader solution or graded cell."""
    found = []
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        if any(is_solution(c) or nbgrader_meta(c).get("grade") for c in read_cells(path)):
            found.append(path)
    return found


LABS = graded_labs()
TEACHER = LABS if os.environ.get("NBDIST_NBGRADER_TEACHER") == "all" else [p for p in LABS if p.stem in TEACHER_LABS]
STUDENT = LABS if os.environ.get("NBDIST_NBGRADER_STUDENT") == "all" else [p for p in LABS if p.stem in STUDENT_LABS]


class Course:
    """A course directory with every graded lab as an assignment named after it, and nbgrader's API on it."""

    def __init__(self, root: Path, labs: list[Path]) -> None:
        from nbgrader.apps import NbGraderAPI
        from nbgrader.coursedir import CourseDirectory
        from traitlets.config import Config

        self.root = root
        for lab in labs:
            (root / "source" / lab.stem).mkdir(parents=True)
            shutil.copy(lab, root / "source" / lab.stem / lab.name)
        config = Config()
        config.CourseDirectory.root = str(root)
        config.CourseDirectory.db_assignments = [{"name": lab.stem} for lab in labs]
        config.CourseDirectory.db_students = [{"id": "teacher"}, {"id": "student"}]
        config.Execute.timeout = CELL_TIMEOUT_S
        config.Execute.startup_timeout = 120
        self.api = NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)

    def path(self, step: str, lab: Path, student: str | None = None) -> Path:
        parts = [step, student, lab.stem, lab.name] if student else [step, lab.stem, lab.name]
        return self.root.joinpath(*parts)

    def scores(self, lab: Path, student: str) -> dict[str, tuple[float, float]]:
        """grade_id -> (score, points) of each graded cell of `student`'s submission, read from the gradebook."""
        from nbgrader.api import Gradebook

        with Gradebook(f"sqlite:///{self.root / 'gradebook.db'}") as gradebook:
            submitted = gradebook.find_submission_notebook(lab.stem, lab.stem, student)
            return {grade.name: (grade.score, grade.max_score) for grade in submitted.grades}


def _nbgrader_on_path() -> None:
    """nbgrader calls its `alembic` command to open the gradebook: the venv's bin must be on PATH even when pytest
    was started as .venv/bin/python without the venv activated."""
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Course:
    """Every graded lab's student version, made by nbgrader's generate_assignment (one course, one gradebook)."""
    _nbgrader_on_path()
    made = Course(tmp_path_factory.mktemp("course"), LABS)
    for lab in LABS:
        result = made.api.generate_assignment(lab.stem)
        assert result["success"], f"nbgrader generate_assignment {lab.stem} failed:\n{result['log'][-3000:]}"
    return made


def submit_and_autograde(course: Course, lab: Path, student: str, notebook: Path) -> nbformat.NotebookNode:
    """`notebook` handed in by `student` for `lab`, graded by nbgrader's autograde; the executed, graded notebook.
    The lab gets what tests/test_notebooks.py gives it (hosts for a notebook about several hosts)."""
    submitted = course.path("submitted", lab, student)
    submitted.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(notebook, submitted)
    with _hosts_for(lab):
        result = course.api.autograde(lab.stem, student)
    assert result["success"], f"nbgrader autograde {lab.stem} for {student} failed:\n{result['log'][-3000:]}"
    import nbformat  # where it is used: the fast tests here do without its second-long import (notebook_files.py)

    return nbformat.read(course.path("autograded", lab, student), as_version=4)


def expected_stub(source: str) -> str:
    """A solution cell as nbgrader should hand it out: each BEGIN/END SOLUTION region replaced by the stub, at the
    region's indentation."""
    return SOLUTION_REGION.sub(lambda m: "\n".join(m.group(1) + line for line in STUB.splitlines()), source)


def errors_of(cell) -> list[str]:
    return [f"{o.ename}: {o.evalue}" for o in cell.get("outputs", []) if o.output_type == "error"]


# -- the exercises themselves (no kernel) -------------------------------------------------------------------------


def test_some_lab_has_graded_exercises():
    assert LABS, "no notebook in notebooks/ has nbgrader cells"


def test_grade_ids_are_unique_across_labs():
    seen: dict[str, str] = {}
    for lab in LABS:
        for cell in read_cells(lab):
            grade_id = nbgrader_meta(cell).get("grade_id")
            if grade_id is None:
                continue
            assert grade_id not in seen, f"grade_id {grade_id!r} is in {seen[grade_id]} and in {lab.name}"
            seen[grade_id] = lab.name


@pytest.mark.parametrize("lab", LABS, ids=[p.stem for p in LABS])
def test_every_exercise_has_a_solution_region_and_a_test(lab):
    """Each solution cell holds a BEGIN/END SOLUTION region and is followed, before the next solution cell, by a
    test cell with points and an assert."""
    cells = read_cells(lab)
    solutions = [i for i, c in enumerate(cells) if is_solution(c)]
    assert solutions, f"{lab.name} has graded cells but no solution cell"
    for k, index in enumerate(solutions):
        grade_id = nbgrader_meta(cells[index])["grade_id"]
        assert SOLUTION_REGION.search(cells[index].source), f"{grade_id}: no ### BEGIN/END SOLUTION region"
        following = cells[index + 1:solutions[k + 1] if k + 1 < len(solutions) else len(cells)]
        tests = [c for c in following if is_test(c)]
        assert tests, f"{grade_id}: no test cell after it"
        for test in tests:
            assert nbgrader_meta(test).get("points", 0) > 0 and "assert" in test.source, nbgrader_meta(test)


# -- (a) the student version --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("lab", LABS, ids=[p.stem for p in LABS])
def test_student_version_has_no_solution_and_every_other_cell_unchanged(course, lab):
    import nbformat

    source = nbformat.read(lab, as_version=4)
    release = nbformat.read(course.path("release", lab), as_version=4)
    assert [c.get("id") for c in release.cells] == [c.get("id") for c in source.cells]
    text = nbformat.writes(release)
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
        assert marker not in text, f"{lab.name}: {marker!r} left in the student version"
    for mine, theirs in zip(source.cells, release.cells):
        assert theirs.cell_type == mine.cell_type
        if is_solution(mine):
            assert theirs.source == expected_stub(mine.source), nbgrader_meta(mine)["grade_id"]
        else:
            assert theirs.source == mine.source, f"{lab.name}: cell {mine.get('id')} changed in the student version"
        assert not theirs.get("outputs"), f"{lab.name}: cell {mine.get('id')} has outputs in the student version"


# -- (b) the teacher's version passes its tests, (c) the student's runs and fails only its exercises -------------


@pytest.mark.parametrize("lab", TEACHER, ids=[p.stem for p in TEACHER])
def test_teacher_version_gets_full_points(course, lab):
    graded = submit_and_autograde(course, lab, "teacher", course.path("source", lab))
    failed = {nbgrader_meta(c).get("grade_id") or c.get("id"): errors_of(c) for c in graded.cells if errors_of(c)}
    assert not failed, f"{lab.name}, the teacher's version, failed in {failed}"
    scores = course.scores(lab, "teacher")
    assert scores and all(score == points for score, points in scores.values()), scores


@pytest.mark.parametrize("lab", STUDENT, ids=[p.stem for p in STUDENT])
def test_student_version_runs_and_fails_only_its_exercises(course, lab):
    graded = submit_and_autograde(course, lab, "student", course.path("release", lab))
    outside = {c.get("id"): errors_of(c) for c in graded.cells
               if c.cell_type == "code" and errors_of(c) and not (is_solution(c) or is_test(c))}
    assert not outside, f"{lab.name}: cells outside the exercises failed with the solutions stubbed: {outside}"
    not_run = [c.get("id") for c in graded.cells if c.cell_type == "code" and c.get("execution_count") is None]
    assert not not_run, f"{lab.name}: cells not run: {not_run}"
    scores = course.scores(lab, "student")
    passing = {grade_id: score for grade_id, (score, points) in scores.items() if score >= points}
    assert scores and not passing, f"{lab.name}: these tests pass without the solutions: {passing}"
