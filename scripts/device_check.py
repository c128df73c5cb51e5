"""The parts of scripts/device_check.sh that are more than shell glue (Python 3.11 and 3.12, standard library at
module level: the GPU machine runs it before anything is installed, this machine runs its tests without a GPU).

    python3 scripts/device_check.py pins                      name==version of every wheel the check carries
    python3 scripts/device_check.py install WHEELS PREFIX     install the carried wheels this machine lacks
    python3 scripts/device_check.py imports                   what the gpu tests import, in one line if missing
    python3 scripts/device_check.py matmul RESULTS            bf16 matmul TFLOP/s against the GPU's peak
    python3 scripts/device_check.py two-engines RESULTS       2 engines on 2 GPUs, or -n 2 refused on one
    python3 scripts/device_check.py summary RESULTS SECONDS   the final line; exit status 1 if anything failed

RESULTS is a folder where each stage leaves a JSON file (matmul.json, two_engines.json) and the pytest log
(pytest.log) for the summary to read.
"""
from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

# What the gpu tests need that the GPU machine lacks: ipyparallel's dependency closure (kernel, controller and
# engines; IPython's own included, since an engine's traceback goes through it), cloudpickle (nbdist.wire), what the
# Trainer's kernel side imports (its dashboard: ipywidgets, anywidget, plotly and their own needs) and an MPI runtime
# (the `mpich` wheel: mpiexec and libmpi for mpi4py). Versions are this project's .venv's where it has them (`pins`
# reads them there); these are used where it does not. Left out, because the GPU machine has them: torch, numpy,
# mpi4py, nvidia-ml-py, psutil, pytest, tqdm, python-dateutil, packaging, typing-extensions. Left out, because
# nothing imports them (ipywidgets' front-end assets): widgetsnbextension, jupyterlab-widgets. pygments and
# cloudpickle may be there already: `install` installs only what the machine lacks.
CARRIED = {
    "ipyparallel": "9.2.0",
    "ipykernel": "7.4.0",
    "ipython": "9.18.1",
    "ipython-pygments-lexers": "1.1.1",
    "jupyter-client": "8.10.0",
    "jupyter-core": "5.9.1",
    "pyzmq": "27.3.0",
    "tornado": "6.6.1",
    "traitlets": "5.16.1",
    "comm": "0.2.3",
    "debugpy": "1.8.22",
    "decorator": "5.3.1",
    "platformdirs": "4.14.9",
    "nest-asyncio2": "1.7.4",
    "matplotlib-inline": "0.2.2",
    "jedi": "0.20.1",
    "parso": "0.8.7",
    "prompt-toolkit": "3.0.53",
    "wcwidth": "0.9.4",
    "pexpect": "4.9.0",
    "ptyprocess": "0.7.0",
    "stack-data": "0.6.3",
    "asttokens": "3.0.2",
    "executing": "2.3.0",
    "pure-eval": "0.2.4",
    "pygments": "2.21.0",
    "cloudpickle": "3.1.3",
    "ipywidgets": "8.1.9",
    "anywidget": "0.11.0",
    "psygnal": "0.16.1",
    "plotly": "7.1.0",
    "narwhals": "2.29.0",
    "mpich": "5.0.2",
}

# What the kernel (pytest), the controller and the engines import on the gpu tests' path (torch is asked for
# separately, first: whether CUDA is there at all).
NEEDED_MODULES = ("numpy", "psutil", "pynvml", "pytest", "cloudpickle", "zmq", "tornado", "traitlets",
                  "jupyter_core", "jupyter_client", "IPython", "ipykernel", "ipyparallel", "ipywidgets", "anywidget",
                  "plotly")

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s: NVIDIA's datasheets give the sparse figure, twice these.
# H200 (SXM): 1,979 sparse -> 989.4 (NVIDIA H200 Tensor Core GPU datasheet, nvidia.com/en-us/data-center/h200/);
# H200 NVL: 1,671 -> 835.5 (same); H100 SXM: 1,979 -> 989.4, H100 PCIe: 1,513 -> 756.5, H100 NVL: 1,671 -> 835.5
# (NVIDIA H100 Tensor Core GPU datasheet, nvidia.com/en-us/data-center/h100/). Matched on torch's device name,
# longest name first; another GPU gets no percentage.
PEAK_BF16_DENSE_TFLOPS = {"H200 NVL": 835.5, "H200": 989.4, "H100 NVL": 835.5, "H100 PCIe": 756.5, "H100": 989.4}

MATMUL_N = 8192
MATMUL_REPS = 20
ALL_REDUCE_BYTES = 256 * 2**20  # NCCL all-reduce bandwidth: one 256 MiB float32 buffer
ALL_REDUCE_REPS = 10
TWO_ENGINE_START_TIMEOUT = 150.0


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


# -- wheels -----------------------------------------------------------------------------------------------------------


def pins() -> list[str]:
    """name==version for every carried wheel: the version installed in this interpreter (the project's .venv when
    scripts/device_wheels.sh asks), else the one above."""
    found = []
    for name, fallback in CARRIED.items():
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = fallback
        found.append(f"{name}=={version}")
    return found


def wheel_distribution(path: str) -> str:
    """The distribution a wheel file holds, from its name (name-version-...-platform.whl)."""
    return canonical(os.path.basename(path).split("-")[0])


def installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def choose_wheels(wheels: list[str], have=installed) -> tuple[list[str], list[str], list[str]]:
    """(wheels to install, distributions already here, carried distributions with no wheel and not here).
    Raises ValueError if a distribution has two wheels (keep one version of each)."""
    by_name: dict[str, str] = {}
    for wheel in sorted(wheels):
        name = wheel_distribution(wheel)
        if name in by_name:
            raise ValueError(f"two wheels of {name} in {os.path.dirname(wheel) or '.'}: "
                             f"{os.path.basename(by_name[name])} and {os.path.basename(wheel)}; keep one")
        by_name[name] = wheel
    here = sorted(name for name in by_name if have(name))
    chosen = [wheel for name, wheel in sorted(by_name.items()) if name not in here]
    lacking = sorted(canonical(name) for name in CARRIED if canonical(name) not in by_name and not have(name))
    return chosen, here, lacking


def site_dir(prefix: str) -> str | None:
    """The site-packages folder `pip install --prefix PREFIX` made (lib/python3.X/site-packages, or Debian's
    dist-packages), or None if it made none."""
    found = sorted(glob.glob(os.path.join(prefix, "lib*", "python3*", "*-packages")))
    return found[0] if found else None


def install(wheel_dir: str, prefix: str) -> int:
    """Install into PREFIX (`pip install --prefix`: --target would drop the mpich wheel's lib/, where libmpi is) the
    carried wheels whose distribution this interpreter lacks; print the shell assignments device_check.sh
    evaluates (SITE, MPI_PREFIX) on stdout, and one line on stderr saying what it did or why it cannot."""
    try:
        chosen, here, lacking = choose_wheels(glob.glob(os.path.join(wheel_dir, "*.whl")))
    except ValueError as e:
        print(f"device check: {e}", file=sys.stderr)
        return 1
    if lacking:
        print(f"device check: this machine lacks {', '.join(lacking)} and {wheel_dir}/ holds no wheel of them "
              "(run scripts/device_wheels.sh where a package registry is reachable, and carry .whl)", file=sys.stderr)
        return 1
    if chosen:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--disable-pip-version-check", "--ignore-installed", "--prefix", prefix, *chosen]
        done = subprocess.run(pip, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()
            print(f"device check: pip could not install the wheels of {wheel_dir}/: {said[-1]}", file=sys.stderr)
            return 1
    mpich = "mpich" in {wheel_distribution(w) for w in chosen}
    print(f"SITE={site_dir(prefix) or ''}")
    print(f"MPI_PREFIX={prefix if mpich else ''}")
    print(f"device check: installed {len(chosen)} wheels into {prefix}"
          + (f" ({', '.join(here)} already here)" if here else ""), file=sys.stderr)
    return 0


def imports() -> int:
    """Import what the gpu tests import, and load the MPI library mpi4py will use (without initialising MPI); one
    line naming whatever is missing."""
    missing = []
    for module in NEEDED_MODULES:
        try:
            __import__(module)
        except Exception as e:  # noqa: BLE001 - any failure to import is reported, in one line
            missing.append(f"{module} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    try:
        import mpi4py

        mpi4py.rc.initialize = False
        from mpi4py import MPI

        library = " ".join(MPI.Get_library_version().splitlines()[0].split())
    except Exception as e:  # noqa: BLE001
        missing.append(f"mpi4py.MPI ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        library = None
    if missing:
        print(f"device check: cannot import {'; '.join(missing)}: carry its wheel in .whl/ "
              "(scripts/device_wheels.sh)")
        return 1
    from nbdist.cluster.options import find_mpiexec

    print(f"device check: everything the gpu tests import is here; MPI: {library}; mpiexec: {find_mpiexec()}")
    return 0


# -- figures ----------------------------------------------------------------------------------------------------------


def peak_for(device_name: str) -> float | None:
    for name in sorted(PEAK_BF16_DENSE_TFLOPS, key=len, reverse=True):
        if name.lower() in device_name.lower():
            return PEAK_BF16_DENSE_TFLOPS[name]
    return None


def matmul(results: str) -> int:
    """bf16 matmul of two 8192 x 8192 matrices on cuda:0, timed with CUDA events over 20 reps after 3 warm-ups."""
    import torch

    n, device = MATMUL_N, torch.device("cuda", 0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(MATMUL_REPS):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1000 / MATMUL_REPS
    name = torch.cuda.get_device_name(device)
    tflops = 2 * n**3 / seconds / 1e12
    report = {"device": name, "tflops": tflops, "peak": peak_for(name), "n": n, "reps": MATMUL_REPS}
    Path(results, "matmul.json").write_text(json.dumps(report))
    peak = report["peak"]
    print(f"bf16 matmul {n}^3 on {name}: {tflops:.1f} TFLOP/s"
          + (f" ({100 * tflops / peak:.0f}% of the dense bf16 peak, {peak} TFLOP/s)" if peak else " (peak unknown)"))
    return 0


def on_rank_all_reduce(nbytes: int, reps: int) -> dict:
    """On a rank: an exact all_reduce of small tensors on the rank's device, then the seconds one all_reduce of
    `nbytes` takes there (after 3 warm-ups; a CUDA device is synchronised before and after)."""
    import time

    import torch
    import torch.distributed as dist

    from nbdist.cluster.launching.ranks.boot import boot

    device = torch.device(boot().device)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rank, n = dist.get_rank(), dist.get_world_size()
    small = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(small)
    exact = torch.equal(small.cpu(), torch.full((4,), n * (n + 1) / 2))
    big = torch.ones(nbytes // 4, device=device)
    for _ in range(3):
        dist.all_reduce(big)
    synchronize()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(big)
    synchronize()
    return {"device": str(device), "backend": str(dist.get_backend()), "exact": exact,
            "seconds": (time.perf_counter() - started) / reps}


def all_reduce_report(ranks: list[dict], nbytes: int, want: str = "cuda") -> dict:
    """What the ranks of on_rank_all_reduce said, as one report: exact on devices of kind `want` or not, and the
    bus bandwidth (nccl-tests' definition: 2 (n - 1) / n bytes per rank over the slowest rank's seconds)."""
    n = len(ranks)
    seconds = max(r["seconds"] for r in ranks)
    busbw = 2 * (n - 1) / n * nbytes / seconds / 1e9
    devices = ", ".join(r["device"] for r in ranks)
    values = all(r["exact"] for r in ranks)
    placed = all(r["device"].startswith(want) for r in ranks)
    said = ("exact" if values else "NOT exact") + ("" if placed else f" (not on {want})")
    return {"ranks": ranks, "exact": values and placed, "busbw_gbs": busbw,
            "summary": f"{'ok' if values and placed else 'WRONG'} on {devices}, all-reduce {busbw:.0f} GB/s bus bandwidth",
            "line": (f"2-engine run: all_reduce {said} on {devices} ({ranks[0]['backend']}); all-reduce of "
                     f"{nbytes >> 20} MiB: {busbw:.1f} GB/s bus bandwidth")}


def refusal_on_one_gpu() -> tuple[bool, str]:
    """Ask for 2 engines with one GPU visible (CUDA_VISIBLE_DEVICES=0): nbdist must refuse before starting anything,
    in one line naming NCCL's one rank per GPU. (ok, what it said)."""
    import nbdist
    from nbdist.cluster.options import ClusterOptions

    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    try:
        nbdist.Cluster(ClusterOptions(n=2))
    except nbdist.DistUsageError as e:
        message = str(e)
        said = message.lower()
        return ("nccl" in said and "\n" not in message and ("per gpu" in said or "gpu per" in said)), message
    except Exception as e:  # noqa: BLE001 - reported
        return False, f"{type(e).__name__}: {e}"
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    return False, "not refused: nbdist accepted 2 engines on one GPU"


def two_engines(results: str) -> int:
    """With 2 or more GPUs: 2 engines, an exact all_reduce on CUDA and NCCL's all-reduce bus bandwidth. With one:
    the run is skipped (NCCL runs one rank per GPU). Either way, -n 2 with one GPU visible must be refused."""
    from nbdist.cluster.options import ClusterOptions, visible_gpus

    gpus = visible_gpus()
    refused, message = refusal_on_one_gpu()
    print(f"2-engine refusal on 1 GPU: {'ok' if refused else 'WRONG'}: {message}")
    report = {"gpus": gpus, "refused": refused, "refusal": message, "ok": refused}
    if gpus < 2:
        report["summary"] = f"skipped, {gpus} GPU"
        print(f"2-engine run: skipped, {gpus} GPU (NCCL runs one rank per GPU)")
    else:
        import nbdist

        try:
            cluster = nbdist.Cluster(ClusterOptions(n=2, timeout=TWO_ENGINE_START_TIMEOUT)).start()
            try:
                ranks = cluster.run(on_rank_all_reduce, ALL_REDUCE_BYTES, ALL_REDUCE_REPS, timeout=120)
            finally:
                cluster.stop()
        except Exception as e:  # noqa: BLE001 - reported in one line, the traceback in the log
            import traceback

            traceback.print_exc()
            first = str(e).splitlines()[0] if str(e) else ""
            report["summary"] = f"FAILED ({type(e).__name__}: {first[:160]})"
            print(f"2-engine run: {report['summary']}")
            report["ok"] = False
        else:
            found = all_reduce_report(ranks, ALL_REDUCE_BYTES)
            print(found.pop("line"))
            report.update(found, ok=refused and found["exact"])
    Path(results, "two_engines.json").write_text(json.dumps(report))
    return 0 if report["ok"] else 1


# -- the summary ------------------------------------------------------------------------------------------------------

_RESULT_LINE = re.compile(r"\bin \d+(?:\.\d+)?s\b")
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?|rerun)\b")


def parse_pytest_counts(text: str) -> dict[str, int] | None:
    """Counts from pytest's last result line ("3 passed, 1 failed, 2 skipped, 4 deselected in 12.3s", "no tests
    ran in 0.01s", with or without -q's missing "=" frame); None if there is none (pytest did not finish).
    "errors" are counted as "error"."""
    for line in reversed(text.splitlines()):
        line = line.strip().strip("=").strip()
        if not _RESULT_LINE.search(line):
            continue
        counts: dict[str, int] = {}
        for number, kind in _COUNT.findall(line):
            kind = {"errors": "error", "warnings": "warning"}.get(kind, kind)
            counts[kind] = counts.get(kind, 0) + int(number)
        if counts or line.startswith("no tests ran"):
            return counts
    return None


_PROGRESS = re.compile(r"^([.sFExX]+)\s*(?:\[\s*\d+%\])?$")


def parse_pytest_progress(text: str) -> dict[str, int]:
    """What `pytest -q` had reported before it was stopped, from its progress lines (".s.F  [ 40%]"): the counts
    so far, errors counted as "error"."""
    kinds = {".": "passed", "s": "skipped", "F": "failed", "E": "error", "x": "xfailed", "X": "xpassed"}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        found = _PROGRESS.match(line.strip())
        if found:
            for mark in found.group(1):
                counts[kinds[mark]] = counts.get(kinds[mark], 0) + 1
    return counts


def summary_line(counts: dict[str, int] | None, two: dict | None, mm: dict | None, seconds: float,
                 pytest_note: str = "") -> tuple[str, bool]:
    """The final line and whether the check passed: pytest ran to its end (no `pytest_note` saying it was stopped),
    every selected gpu test passed or skipped, at least one passed, and the 2-engine stage (the run, or the refusal)
    did what it must. The matmul is a figure, not a check."""
    problems = []
    if counts is None:
        tests = f"no gpu test result ({pytest_note or 'pytest printed no result line'})"
        problems.append("pytest")
    else:
        failed = counts.get("failed", 0) + counts.get("error", 0)
        tests = f"{counts.get('passed', 0)}/{failed}/{counts.get('skipped', 0)} gpu tests"
        if pytest_note:  # stopped before its end: the counts are those of its progress so far
            tests += f" ({pytest_note})"
            problems.append("pytest")
        if failed:
            problems.append("failed tests")
        elif not counts.get("passed"):
            problems.append("no gpu test passed")
    if two is None:
        engines = "not run"
        problems.append("2-engine")
    else:
        engines = two.get("summary", "?") + ("; -n 2 on 1 GPU refused in one line" if two.get("refused")
                                             else "; -n 2 on 1 GPU NOT refused in one line")
        if not two.get("ok"):
            problems.append("2-engine")
    if mm is None:
        figure = "bf16 matmul not measured"
    else:
        peak = mm.get("peak")
        figure = f"bf16 matmul {mm['tflops']:.0f} TFLOP/s" + (f" ({100 * mm['tflops'] / peak:.0f}% of peak)"
                                                              if peak else " (peak unknown)")
    line = f"device check: {tests}, 2-engine: {engines}, {figure}, {seconds:.0f} s"
    if problems:
        line += f" -- FAILED: {', '.join(problems)}"
    return line, not problems


def summary(results: str, seconds: float) -> int:
    def read(name: str) -> dict | None:
        try:
            return json.loads(Path(results, name).read_text())
        except (OSError, ValueError):
            return None

    log = Path(results, "pytest.log")
    text = log.read_text(errors="replace") if log.exists() else ""
    note_file = Path(results, "pytest.note")
    note = note_file.read_text().strip() if note_file.exists() else ""
    counts = parse_pytest_counts(text)
    if counts is None and note:
        counts = parse_pytest_progress(text)
        note += ", counted so far"
    line, ok = summary_line(counts, read("two_engines.json"), read("matmul.json"), seconds, note)
    print(line)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pins")
    p = sub.add_parser("install")
    p.add_argument("wheels")
    p.add_argument("prefix")
    sub.add_parser("imports")
    for name in ("matmul", "two-engines"):
        sub.add_parser(name).add_argument("results")
    p = sub.add_parser("summary")
    p.add_argument("results")
    p.add_argument("seconds", type=float)
    args = parser.parse_args(argv)
    if args.command == "pins":
        print("\n".join(pins()))
        return 0
    if args.command == "install":
        return install(args.wheels, args.prefix)
    if args.command == "imports":
        return imports()
    if args.command == "matmul":
        return matmul(args.results)
    if args.command == "two-engines":
        return two_engines(args.results)
    return summary(args.results, args.seconds)


if __name__ == "__main__":
    sys.exit(main())
