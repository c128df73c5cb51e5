"""The README and docs/ stay true: their links resolve and their runnable examples run.

Why: the README points into docs/ and benchmarks/, the pages point at each other, and their examples are what a
user pastes first. Both rot quietly when the package moves. So:

- Links. Every relative link of README.md, docs/*.md and benchmarks/README.md (`[text](path)`,
  `[text](path#anchor)`, `[text](#anchor)`) names a file or folder that exists, and an anchor into a Markdown page
  names one of its headings (GitHub's slugs). Links inside code are not links; web addresses are not followed.
- Runnable blocks. A code block of README.md or docs/*.md is run when the line directly above its ```python fence
  is the HTML comment `<!-- runnable -->` (GitHub does not show it). The runnable blocks of one page run in order,
  in one namespace: a page is a story. Blocks not marked (magics, several hosts, GPUs, sketches that leave names
  out) are not run. A magic cannot run here: a marked block that holds one fails.
- Which test runs a page. A page whose runnable blocks start MPI engines (they contain `nbdist.start(`,
  `nbdist.Cluster(` or `%dist_start`: STARTS_ENGINES) runs in test_runnable_blocks_on_a_cluster, which
  tests/conftest.py marks `cluster`. The link check and the other pages are `fast` tests, and conftest fails a fast
  test that starts engines, so a page put on the wrong side is caught.

Keep runnable blocks small and CPU-cheap: 2 engines, tiny models, a few steps. A page that needs a cluster starts
it itself with 2 engines; that returns the running cluster where there is one (the test session's shared one). A
cluster the test started is stopped at the end, even when a block fails.
"""
from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINKED_PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")])
RUN_PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

MARKER = "<!-- runnable -->"
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
STARTS_ENGINES = re.compile(r"\bnbdist\.start\(|\bnbdist\.Cluster\(|%dist_start\b")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+).+?\1")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    runnable: bool

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def read_page(page: Path) -> tuple[list[str], list[Block]]:
    """The page's lines outside fenced code (code lines blanked, so line numbers hold) and its fenced blocks."""
    lines = page.read_text(encoding="utf-8").splitlines()
    prose, blocks = [], []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i].strip())
        if not opening:
            prose.append(lines[i])
            i += 1
            continue
        fence, language, start = opening.group(1), opening.group(2).lower(), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        marked = start > 0 and lines[start - 1].strip() == MARKER
        blocks.append(Block(page, start + 1, language, "\n".join(body) + "\n", marked))
        prose += [""] * (min(i, len(lines) - 1) - start + 1)
        i += 1
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in read_page(page)[0]:
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    problems = []
    for number, line in enumerate(read_page(page)[0], start=1):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match.group(1)
            if SCHEME.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            goal = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}:{number}: ({target})"
            if not goal.exists():
                problems.append(f"{where} names no file")
            elif anchor and goal.suffix == ".md" and anchor not in anchors(goal):
                problems.append(f"{where}: {goal.name} has no heading #{anchor}")
    return problems


def runnable(page: Path) -> list[Block]:
    return [block for block in read_page(page)[1] if block.runnable]


def starts_engines(page: Path) -> bool:
    return any(STARTS_ENGINES.search(block.code) for block in runnable(page))


def run_story(page: Path, namespace: dict) -> str | None:
    """Run the page's runnable blocks in order in `namespace`; None, or what went wrong (the first failure)."""
    for block in runnable(page):
        if block.language != "python":
            return f"{block.where}: {MARKER} stands above a {block.language or 'plain'} block, not ```python"
        if re.search(r"^\s*%", block.code, re.MULTILINE):
            return f"{block.where}: a magic cannot run here: leave this block unmarked"
        try:
            exec(compile(block.code, block.where, "exec"), namespace)  # noqa: S102 - the project's own pages
        except BaseException as e:  # a KeyboardInterrupt from nbdist (DistInterrupt) is a failure of the block too
            if type(e) is KeyboardInterrupt:
                raise
            return f"{block.where}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"
    return None


FAST_PAGES = [page for page in RUN_PAGES if runnable(page) and not starts_engines(page)]
CLUSTER_PAGES = [page for page in RUN_PAGES if starts_engines(page)]


def test_links_resolve() -> None:
    problems = [problem for page in LINKED_PAGES for problem in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_markers_sit_above_python_blocks() -> None:
    """A marker that does not stand directly above a ```python fence would leave its block unrun, silently."""
    problems = []
    for page in RUN_PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, start=1):
            if line.strip() == MARKER and (number >= len(lines) or FENCE.match(lines[number].strip()) is None):
                problems.append(f"{page.relative_to(ROOT)}:{number}: {MARKER} is not directly above a code fence")
    assert not problems, "\n".join(problems)
    assert FAST_PAGES and CLUSTER_PAGES, "no runnable block found: is the marker still " + MARKER + "?"


@pytest.mark.parametrize("page", FAST_PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_runnable_blocks_without_a_cluster(page: Path) -> None:
    failed = run_story(page, {"__name__": "__main__"})
    assert failed is None, failed


def test_runnable_blocks_on_a_cluster() -> None:
    """The pages whose runnable blocks start engines (each with nbdist.start(2)), one after the other: the first
    starts the cluster (or finds the running one), the others find it. Every page runs, even after another fails; a
    cluster started here is stopped at the end."""
    import nbdist

    def running() -> nbdist.Cluster | None:
        try:
            return nbdist.current()
        except nbdist.DistUsageError:
            return None

    before = running()
    namespaces: list[dict] = []
    failures = []
    try:
        for page in CLUSTER_PAGES:
            namespaces.append({"__name__": "__main__"})
            failed = run_story(page, namespaces[-1])
            if failed:
                failures.append(failed)
    finally:
        for namespace in namespaces:
            for value in namespace.values():
                if isinstance(value, nbdist.Cluster) and value is not before and value.running:
                    value.stop()
        if running() is not None and running() is not before:
            nbdist.stop()
    assert not failures, "\n\n".join(failures)
