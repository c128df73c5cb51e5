"""The package's layers, read from its source: drawing depends on data only, no import cycles, the capabilities'
folders stand in layers, and what runs on the engines is told apart from what runs in the notebook kernel by path.

The rule (ARCHITECTURE.md): code under a `ranks/` folder runs ON the engines (torch.distributed, MPI, CUDA); code
outside runs in the kernel (or is plain data that runs anywhere) and imports neither torch.distributed nor mpi4py at
module level. A rank module imports rank modules, the plain data every floor shares, and its own feature's shared
part (a spec), never a kernel-only module. A kernel module may refer to a rank function to send it
(`cluster.run(nbdist.cluster.launching.ranks.boot.info)`) but defines none of its own to send.

Imports are read with `ast` from every nbdist/**/*.py, at module level and inside functions; only `if
TYPE_CHECKING:` blocks are left out (they never run). The viz check runs real imports in a fresh interpreter.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import nbdist

PACKAGE = Path(nbdist.__file__).parent
KERNEL_ONLY = ("nbdist.cluster.api", "nbdist.cluster.hosts.lifeline_server", "nbdist.cluster.waiting.remote", "nbdist.cluster.launching.launch",
               "nbdist.widgets", "nbdist.viz", "nbdist.magics", "nbdist.collectives.sweep",
               "nbdist.collectives.tracing", "nbdist.collectives.costmodel", "nbdist.sharding.plan",
               "nbdist.sharding.sharded", "nbdist.sharding.explorer", "nbdist.pipeline_parallel.api",
               "nbdist.pipeline_parallel.view", "nbdist.training.trainer", "nbdist.training.dashboard",
               "nbdist.training.checkpoints", "nbdist.planner")
ENGINE_ONLY_LIBRARIES = ("torch.distributed", "torch.nn.parallel", "mpi4py")  # torch.nn.parallel: DDP
COMPUTING = ("nbdist.cluster.api", "nbdist.cluster.waiting.remote", "nbdist.cluster.launching.launch", "nbdist.collectives.sweep",
             "nbdist.collectives.tracing", "nbdist.collectives.costmodel", "nbdist.pipeline_parallel")
SENDERS = ("run", "run_each", "apply", "apply_async", "apply_sync", "map", "map_async")  # ways to ship a function
# The imports that run back up the folders' layers, each with its reason (ARCHITECTURE.md names them too).
BACK_UP = {
    ("nbdist.schedules.simulate", "nbdist.viz.timeline"):
        "Timeline.figure(): a simulated or measured timeline draws itself where users ask for it; the drawing reads "
        "the schedules' action kinds",
}


def is_rank_side(module: str) -> bool:
    return ".ranks." in module + "."


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def within(name: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@dataclass
class Imports:
    """What one module imports: (target, line, at module level?) for every import statement, resolved to the
    deepest nbdist module where the target is one, and the names of the functions it sends to the ranks."""

    module: str
    found: list[tuple[str, int, bool]] = field(default_factory=list)
    sent_own: list[tuple[str, int]] = field(default_factory=list)

    def of_nbdist(self, module_level_only: bool = False) -> set[str]:
        return {t for t, _, top in self.found if t in MODULES and t != self.module and (top or not module_level_only)}


class _Reader(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool):
        self.out = Imports(module)
        self.package = module if is_package else module.rpartition(".")[0]
        self.depth = 0  # functions we are inside
        self.own_functions: set[str] = set()

    def visit_FunctionDef(self, node):
        self.own_functions.add(node.name)
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node):
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            return  # never runs
        self.generic_visit(node)

    def visit_Import(self, node):
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node):
        base = node.module or ""
        if node.level:
            package = self.package.split(".")
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in MODULES else base, node.lineno)

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in SENDERS and node.args:
            first = node.args[0]
            if isinstance(first, ast.Lambda):
                self.out.sent_own.append(("lambda", node.lineno))
            elif isinstance(first, ast.Name):
                self.out.sent_own.append((first.id, node.lineno))  # kept if it names a function defined here
        self.generic_visit(node)

    def _add(self, target: str, line: int) -> None:
        while target not in MODULES and within(target, "nbdist") and "." in target:
            target = target.rpartition(".")[0]  # nbdist.x.name -> nbdist.x
        self.out.found.append((target, line, self.depth == 0))


def read(module: str, source: str | None = None) -> Imports:
    path = MODULES.get(module)
    reader = _Reader(module, path is not None and path.name == "__init__.py")
    reader.visit(ast.parse(source if source is not None else path.read_text()))
    out = reader.out
    out.sent_own = [(name, line) for name, line in out.sent_own if name == "lambda" or name in reader.own_functions]
    return out


IMPORTS = {module: read(module) for module in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle found by depth-first search (each reported once, from its smallest module)."""
    found: set[tuple[str, ...]] = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                found.add(tuple(path))
            elif nxt > start and nxt not in path:
                walk(start, nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return [list(c) + [c[0]] for c in sorted(found)]


# -- (a) drawing depends on data only -------------------------------------------------------------------------------

VIZ_MODULES = sorted(m for m in MODULES if within(m, "nbdist.viz"))


@pytest.mark.parametrize("modules", [VIZ_MODULES] + [[m] for m in VIZ_MODULES], ids=["all"] + VIZ_MODULES)
def test_viz_imports_no_torch_distributed_nor_the_modules_that_compute(modules):
    code = (f"import sys, json\nimport {', '.join(modules)}\n"
            "print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout)
    assert not [m for m in loaded if within(m, ("torch", "mpi4py"))]  # torch brings torch.distributed with it
    assert not [m for m in loaded if within(m, COMPUTING)]


# -- (b) no import cycle --------------------------------------------------------------------------------------------


def test_no_import_cycle_at_module_level():
    graph = {m: imports.of_nbdist(module_level_only=True) for m, imports in IMPORTS.items()}
    assert cycles(graph) == []


def test_no_import_cycle_counting_imports_inside_functions_too():
    """A lazy import is still a dependency: counting imports inside functions, the graph is acyclic too. (The
    package's own `__init__`, which re-exports lazily, is left out.)"""
    graph = {m: imports.of_nbdist() - {"nbdist"} for m, imports in IMPORTS.items()}
    assert cycles(graph) == []


def test_the_reader_finds_imports_at_both_levels():
    """The graph the cycle tests read is not empty by mistake: known edges are in it, at the right level."""
    sweep = IMPORTS["nbdist.collectives.sweep"]
    assert "nbdist.collectives.ops" in sweep.of_nbdist(module_level_only=True)
    assert "nbdist.collectives.ranks.collective_timing" in sweep.of_nbdist() - sweep.of_nbdist(module_level_only=True)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    sample = read("nbdist.sample", "from nbdist.cluster.launching.ranks import boot\ndef f(): pass\n"
                                   "def g(cluster, h):\n    cluster.run(f); cluster.run(h); cluster.run(lambda: 1)\n"
                                   "    cluster.run(boot.info)\n")
    assert [name for name, _ in sample.sent_own] == ["f", "lambda"]  # h is a parameter, boot.info rank code
    assert sample.found == [("nbdist.cluster.launching.ranks.boot", 1, True)]


# -- (c) the engines' code and the kernel's, by path ---------------------------------------------------------------

KERNEL_MODULES = sorted(m for m in MODULES if not is_rank_side(m))
RANK_MODULES = sorted(m for m in MODULES if is_rank_side(m))


def feature(module: str) -> str:
    """The capability a module belongs to: nbdist.pipeline_parallel.ranks.executor -> nbdist.pipeline_parallel."""
    return ".".join(module.split(".")[:2])


@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_kernel_module_imports_no_engine_library_at_module_level(module):
    found = [(t, line) for t, line, top in IMPORTS[module].found if top and within(t, ENGINE_ONLY_LIBRARIES)]
    assert found == [], f"{module} imports {found} at module level: engine code belongs under a ranks/ folder"


@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_kernel_module_sends_no_function_of_its_own_to_the_ranks(module):
    """A heuristic for 'defines code that runs on the engines': a function (or lambda) defined in the module and
    passed to cluster.run / run_each / an ipyparallel view's apply."""
    assert IMPORTS[module].sent_own == []


@pytest.mark.parametrize("module", RANK_MODULES)
def test_rank_module_imports_no_kernel_module(module):
    found = [(t, line) for t, line, _ in IMPORTS[module].found if within(t, KERNEL_ONLY)]
    assert found == [], f"{module} imports kernel modules {found}"


@pytest.mark.parametrize("module", RANK_MODULES)
def test_rank_module_imports_only_its_own_features_shared_part(module):
    """A rank half reads what both halves share in its own feature (a spec); another feature's kernel half never."""
    found = [(t, line) for t, line, _ in IMPORTS[module].found
             if t in MODULES and not is_rank_side(t) and t not in SHARED and feature(t) != feature(module)]
    assert found == [], f"{module} imports another feature's kernel-side modules {found}"


SHARED = {m for m in MODULES if within(m, ("nbdist.errors", "nbdist.checks", "nbdist.units", "nbdist.wire",
                                           "nbdist.models", "nbdist.data", "nbdist.schedules", "nbdist.cost",
                                           "nbdist.layout", "nbdist.cluster.meshes.mesh"))}  # plain data, every floor


# -- (d) the folders stand in layers ----------------------------------------------------------------------------------


def room(module: str) -> str:
    """A top-level folder or module of the package: the unit the layers are drawn in."""
    return ".".join(module.split(".")[:2])


def test_folders_stand_in_layers_with_only_the_named_imports_running_back_up():
    """Drawn in layers (a folder above all it imports), no import runs back up except those named in BACK_UP:
    with those left out, the folders' graph has no cycle."""
    graph: dict[str, set[str]] = {}
    for m, imports in IMPORTS.items():
        for t in imports.of_nbdist() - {"nbdist"}:
            if room(m) != room(t) and (m, t) not in BACK_UP:
                graph.setdefault(room(m), set()).add(room(t))
    assert cycles(graph) == []
    assert len(BACK_UP) <= 3
    for m, t in BACK_UP:
        assert t in IMPORTS[m].of_nbdist(), f"{m} no longer imports {t}: take it out of BACK_UP"


def test_no_package_module_is_over_450_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 450}
    assert long == {}
