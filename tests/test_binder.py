"""Binder works: an environment built from binder/'s files alone runs the quick start.

What Binder (repo2docker) does, done here: a fresh virtual environment of binder/runtime.txt's Python, then
`pip install -r binder/requirements.txt`, then `binder/postBuild` run from the repository's root (a copy of it, as
repo2docker copies the repository into the image), then notebooks/00_quickstart.ipynb executed headless with that
environment's own kernel. Nothing of the venv that runs pytest is used.

One substitution, and only one (TORCH_SUBSTITUTION below, printed when the test runs): binder/requirements.txt takes
`torch==2.13.0+cpu` from torch's own CPU wheel index, which this machine and CI cannot reach. The test installs
`torch==2.13.0` from the registry they do reach instead: the same release, resolved to the CPU build that lies on
this machine's disk (pip's find-links), so torch is not downloaded again; pip's cache serves the other packages on
later runs. On a fresh machine the set-up downloads JupyterLab, MPICH and the rest: a few minutes.

The venv with binder/requirements.txt installed is built once per content of binder/ and kept in the user's cache
(~/.cache/nbdist-tests/binder-<hash of runtime.txt, requirements.txt, postBuild>), so a later run of the suite
reuses it; postBuild (nbdist itself, from the copy of the repository) runs every time. NBDIST_BINDER_FRESH=1 builds
a fresh venv in the test's own folder instead.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
BINDER = REPO / "binder"
QUICKSTART = REPO / "notebooks" / "00_quickstart.ipynb"

# requirements.txt line -> what this test installs instead (None: the line is dropped)
TORCH_SUBSTITUTION = {
    "--extra-index-url https://download.pytorch.org/whl/cpu": None,  # torch's own index: not reachable here
    "torch==2.13.0+cpu": "torch==2.13.0",  # the same release from the reachable registry (the CPU build on disk)
}
INSTALL_TIMEOUT_S = 1800
RUN_TIMEOUT_S = 900


def requirements_reachable_here() -> tuple[str, list[str]]:
    """binder/requirements.txt with TORCH_SUBSTITUTION applied, and a line per substitution made."""
    kept, said = [], []
    for line in (BINDER / "requirements.txt").read_text().splitlines():
        stripped = line.strip()
        if stripped in TORCH_SUBSTITUTION:
            instead = TORCH_SUBSTITUTION[stripped]
            said.append(f"binder/requirements.txt: {stripped!r} -> {instead!r} (torch's own CPU index is not reachable "
                        "here; the same release from the registry that is)")
            if instead is not None:
                kept.append(instead)
        else:
            kept.append(line)
    return "\n".join(kept) + "\n", said


def runtime_python() -> str:
    """The Python binder/runtime.txt asks for (python-3.11 -> "3.11"): this machine's python3 must be it."""
    found = re.fullmatch(r"python-(\d+\.\d+)", (BINDER / "runtime.txt").read_text().strip())
    assert found, f"binder/runtime.txt: {(BINDER / 'runtime.txt').read_text()!r} is not python-X.Y"
    return found.group(1)


def repository_copy(target: Path) -> Path:
    """The files git tracks (or would: untracked, not ignored), as repo2docker copies the repository."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    for name in listed:
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def binder_env(venv: Path) -> dict[str, str]:
    """The environment of Binder's user: the venv first on PATH, no other Jupyter data (the pytest venv's kernel
    must not be found), pip's cache kept."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "VIRTUAL_ENV", "PYTHON", "NBDIST"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def run(command: list[str], cwd: Path, env: dict, timeout: int) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    return done.stdout


def venv_folder(tmp_path: Path) -> Path:
    """Where the Binder venv is built: the user's cache, one folder per content of binder/ (see the docstring)."""
    if os.environ.get("NBDIST_BINDER_FRESH") == "1":
        return tmp_path / "venv"
    digest = hashlib.sha256()
    for name in ("runtime.txt", "requirements.txt", "postBuild"):
        digest.update((BINDER / name).read_bytes())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nbdist-tests"
    return cache / f"binder-{digest.hexdigest()[:16]}"


def built_venv(venv: Path, repo: Path, requirements_file: Path) -> str:
    """binder/requirements.txt installed in `venv` (a venv of binder/runtime.txt's Python), unless a complete one is
    there already; says which. One build at a time (a lock beside it)."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    complete = venv / "nbdist-binder-complete"
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete.exists():
            return f"Binder venv reused: {venv} (built earlier from the same binder/ files)"
        shutil.rmtree(venv, ignore_errors=True)  # a build that did not finish
        python = shutil.which(f"python{runtime_python()}") or sys.executable
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        env = binder_env(venv)
        version = run([str(venv / "bin" / "python"), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                      repo, env, 60).strip()
        assert version == runtime_python(), \
            f"binder/runtime.txt asks for Python {runtime_python()}; the venv has {version}"
        run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-r", str(requirements_file)],
            repo, env, INSTALL_TIMEOUT_S)
        complete.write_text("binder/requirements.txt installed\n")
        return f"Binder venv built: {venv}"


def test_binder_environment_runs_the_quickstart(tmp_path):
    started = time.perf_counter()
    repo = repository_copy(tmp_path / "repo")
    requirements, substitutions = requirements_reachable_here()
    print("\n".join(substitutions))
    (tmp_path / "requirements.txt").write_text(requirements)
    venv = venv_folder(tmp_path)
    print(built_venv(venv, repo, tmp_path / "requirements.txt"))
    env = binder_env(venv)
    version = run([str(venv / "bin" / "python"), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                  repo, env, 60).strip()
    assert version == runtime_python(), f"binder/runtime.txt asks for Python {runtime_python()}; the venv has {version}"
    run(["bash", str(repo / "binder" / "postBuild")], repo, env, INSTALL_TIMEOUT_S)
    installed = time.perf_counter() - started
    torch_version = run([str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"], repo, env, 120)
    print(f"torch in the Binder venv: {torch_version.strip()}")

    kernels = json.loads(run([str(venv / "bin" / "jupyter"), "kernelspec", "list", "--json"], repo, env, 60))
    python3 = kernels["kernelspecs"]["python3"]["resource_dir"]
    assert Path(python3).is_relative_to(venv), f"the python3 kernel is not the Binder venv's: {python3}"
    executed = tmp_path / "00_quickstart.ipynb"
    run([str(venv / "bin" / "jupyter"), "nbconvert", "--to", "notebook", "--execute", str(repo / "notebooks" /
         QUICKSTART.name), "--output", str(executed), f"--ExecutePreprocessor.timeout={RUN_TIMEOUT_S}",
         "--ExecutePreprocessor.kernel_name=python3"], repo / "notebooks", env, RUN_TIMEOUT_S)
    import nbformat

    nb = nbformat.read(executed, as_version=4)
    errors = [o for cell in nb.cells for o in cell.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")
    print(f"Binder environment set up in {installed:.0f} s; quick start ran in "
          f"{time.perf_counter() - started - installed:.0f} s")
