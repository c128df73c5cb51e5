"""scripts/gpu_check.py, the GPU smoke check, exercised where CI runs (no GPU): it says so in one line without a GPU,
its --on-cpu run passes every check that has a CPU meaning on real CPU engines (and skips, never passes, the
CUDA-only ones), and its recorder keeps going past a failing or overrunning check."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nbdist.data_parallel.ranks.hooks import HOOKS

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
CHECKS = [  # in the order the script runs them; True: needs CUDA
    ("engine_on_device", False),
    ("kernel_no_cuda_context", True),
    ("collectives_cuda_tensors", True),
    ("collectives_cpu_tensors", False),
    ("collectives_benchmark", False),
    ("ddp_hooks", False),
    ("pipeline_equals_serial", False),
    ("pipeline_timeline_vs_wall", False),
    ("stuck_cell_freed_by_timeout", False),
    ("kernel_no_cuda_context_at_end", True),
    ("engines_gone_after_stop", False),
    ("gpu_free_after_stop", True),
    ("one_gpu_two_engines_message", True),
]
CPU_RUN_SECONDS = 90  # the brief's bound for --on-cpu here (2 cores)


def run_script(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})})


def load_script():
    """The script as a module (registered first: its dataclasses look their module up while being made)."""
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
        sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["gpu_check"])
    return sys.modules["gpu_check"]


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
    out = tmp_path / "summary.json"
    done = run_script("--out", str(out), env={"CUDA_VISIBLE_DEVICES": ""})  # no GPU visible, on any machine
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and "no GPU" in lines[0], done.stdout
    assert not out.exists()


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "summary.json"
    started = time.monotonic()
    done = run_script("--on-cpu", "--out", str(out))
    return done, json.loads(out.read_text()), time.monotonic() - started


def test_on_cpu_every_cpu_check_passes_and_the_cuda_ones_are_skipped(cpu_run):
    done, summary, seconds = cpu_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [c["name"] for c in summary["checks"]] == [name for name, _ in CHECKS]
    for check, (name, needs_cuda) in zip(summary["checks"], CHECKS):
        if needs_cuda:
            assert check["status"] == "skipped: no GPU" and check["passed"] is False, check
        else:
            assert check["status"] == "passed" and check["passed"] is True, check
        assert isinstance(check["seconds"], float) and isinstance(check["detail"], dict)
    assert summary["passed"] is True
    assert summary["torch"] and "cuda" in summary and "gpu" in summary
    assert seconds < CPU_RUN_SECONDS * 2, f"the --on-cpu run took {seconds:.0f} s"  # 2x: other runs share the cores


def test_on_cpu_the_checks_measured_what_they_claim(cpu_run):
    _, summary, _ = cpu_run
    checks = {c["name"]: c["detail"] for c in summary["checks"]}
    assert checks["engine_on_device"]["rows"][0]["device"] == "cpu"
    assert set(checks["collectives_cpu_tensors"]["ops"].values()) == {"ok"}
    rows = checks["collectives_benchmark"]["rows"]
    assert rows and all(r["checked"] and r["backend"] == "mpi4py" and r["seconds"] > 0 for r in rows)
    hooks = checks["ddp_hooks"]["hooks"]
    assert set(hooks) == {"auto", *HOOKS} and {h["outcome"] for h in hooks.values()} == {"equal"}
    steps = checks["pipeline_equals_serial"]["steps"]
    assert set(steps) == {"1f1b v=1", "interleaved-1f1b v=2"}
    assert all(s["max_grad_difference"] <= checks["pipeline_equals_serial"]["atol"] for s in steps.values())
    timed = checks["pipeline_timeline_vs_wall"]["steps"]
    assert len(timed) == 3 and all(0 < s["makespan_s"] <= s["wall_s"] for s in timed)
    stuck = checks["stuck_cell_freed_by_timeout"]
    assert "timed out after" in stuck["message"] and stuck["after"] in ("usable", "restartable")
    assert checks["engines_gone_after_stop"]["processes_before_stop"] > 0
    printed = cpu_run[0].stdout
    assert printed.count("[passed]") == sum(not cuda for _, cuda in CHECKS)


def test_a_failing_or_overrunning_check_is_recorded_and_the_next_still_runs():
    script = load_script()

    def fails(run):
        raise script.CheckFailed("the claim did not hold", {"seen": 1})

    def overruns(run):
        time.sleep(5)
        return {}

    run = script.Run(gpu=False)  # no cluster: these checks need none
    records = [script.run_one(run, script.Check(name, fn, needs_gpu=False, limit_seconds=1))
               for name, fn in (("fails", fails), ("overruns", overruns), ("passes", lambda run: {"summary": "ok"}))]
    assert [r["status"] for r in records] == ["failed", "failed", "passed"]
    assert records[0]["detail"] == {"error": "CheckFailed: the claim did not hold", "seen": 1}
    assert records[1]["detail"]["error"] == "ran past its limit of 1 s" and records[1]["seconds"] < 3


def test_unknown_check_names_are_refused():
    with pytest.raises(SystemExit, match="unknown check"):
        load_script().selected("ddp_hooks,no_such_check")
