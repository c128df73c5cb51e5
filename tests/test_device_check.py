"""scripts/device_check.sh (issue 20) where there is no CUDA: one line, exit status 0; and the logic of its helper
scripts/device_check.py: reading pytest's output, the summary line and its verdict, which carried wheels to
install, the GPU's peak, that what the gpu tests import is carried or on the GPU machine already, and the
2-engine run's rank half (on the shared CPU cluster: the GPU machine has one GPU, so it never runs there).

The GPU half of the script runs on a GPU machine only (docs/gpus.md); nothing here uses CUDA.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device_check.sh"
_spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
device_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(device_check)

# What the GPU machine has already (the brief's list): the helper carries none of them.
ON_THE_GPU_MACHINE = {"torch", "numpy", "mpi4py", "nvidia-ml-py", "psutil", "pytest", "tqdm", "python-dateutil",
                      "packaging", "typing-extensions"}


def run_check(env_changes: dict[str, str], path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_changes}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def assert_one_no_cuda_line(done: subprocess.CompletedProcess, reason: str) -> None:
    said = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 0, (done.returncode, said)
    assert len(said) == 1, said
    assert said[0].startswith("device check: no CUDA here (") and said[0].endswith("; nothing to check"), said
    assert reason in said[0], said


# -- the script without CUDA ------------------------------------------------------------------------------------------


def test_without_nvidia_smi_the_check_says_no_cuda_in_one_line_and_exits_0():
    if shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi is here: the check would run for minutes (CUDA_VISIBLE_DEVICES=-1 is tested below)")
    assert_one_no_cuda_line(run_check({}), "nvidia-smi not found")


@pytest.mark.parametrize("hidden", ["", "-1"])
def test_with_every_gpu_hidden_the_check_says_no_cuda_in_one_line_and_exits_0(hidden):
    assert_one_no_cuda_line(run_check({"CUDA_VISIBLE_DEVICES": hidden}), "CUDA_VISIBLE_DEVICES")


@pytest.mark.slow
def test_a_gpu_listed_but_torch_without_cuda_is_no_cuda_in_one_line(tmp_path):
    """nvidia-smi lists a GPU (a stand-in here) but torch, a CPU build, has no CUDA: the line says both."""
    import torch

    if torch.version.cuda is not None:
        pytest.skip(f"torch {torch.__version__} is a CUDA build: the check would run")
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-0)"\n')
    fake.chmod(0o755)
    done = run_check({"PYTHON": sys.executable}, path=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert_one_no_cuda_line(done, "torch.cuda.is_available() is not True")
    assert "lists 1 GPU" in done.stdout, done.stdout


# -- pytest's output --------------------------------------------------------------------------------------------------

# Result lines of real runs: the gpu test files here (CPU), with -m gpu here, a run with failures, a long run.
REAL_RESULT_LINES = [
    ("34 passed, 39 skipped in 56.59s", {"passed": 34, "skipped": 39}),
    ("39 skipped, 34 deselected in 2.64s", {"skipped": 39, "deselected": 34}),
    ("17 failed, 9 passed, 26 skipped in 36.68s", {"failed": 17, "passed": 9, "skipped": 26}),
    ("11 passed, 13 skipped in 95.57s (0:01:35)", {"passed": 11, "skipped": 13}),
    ("========== 1 failed, 2 passed, 1 skipped, 1 xfailed, 1 error in 0.08s ==========",
     {"failed": 1, "passed": 2, "skipped": 1, "xfailed": 1, "error": 1}),
    ("6 deselected in 0.01s", {"deselected": 6}),
    ("no tests ran in 0.01s", {}),
]


@pytest.mark.parametrize("line, counts", REAL_RESULT_LINES)
def test_pytest_result_lines_are_counted(line, counts):
    text = f"..s.F                                                                    [100%]\n{line}\n"
    assert device_check.parse_pytest_counts(text) == counts


def test_output_without_a_result_line_is_no_result():
    """pytest stopped by the wall limit: progress, no result line."""
    text = "gpu tests: pytest -m gpu tests/test_gpu.py\n..s.F.s\n"
    assert device_check.parse_pytest_counts(text) is None
    assert device_check.parse_pytest_progress(text) == {"passed": 4, "skipped": 2, "failed": 1}


MIXED = '''import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture fails")

def test_a(): pass
def test_b(): pass
def test_c(): assert 0
def test_d(): pytest.skip("no")
def test_e(broken): pass
@pytest.mark.xfail
def test_f(): assert 0
'''


@pytest.mark.slow
@pytest.mark.parametrize("quiet", [True, False])
def test_a_real_pytest_run_is_counted_from_its_result_line_and_from_its_progress(tmp_path, quiet):
    (tmp_path / "test_mixed.py").write_text(MIXED)
    done = subprocess.run([sys.executable, "-m", "pytest", *(["-q"] if quiet else []), "-p", "no:cacheprovider",
                           "test_mixed.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    want = {"passed": 2, "failed": 1, "skipped": 1, "xfailed": 1, "error": 1}
    assert device_check.parse_pytest_counts(done.stdout) == want, done.stdout
    if quiet:  # -q's progress line: "..FsEx  [100%]"
        assert device_check.parse_pytest_progress(done.stdout) == want, done.stdout


# -- the summary line -------------------------------------------------------------------------------------------------

ONE_GPU = {"summary": "skipped, 1 GPU", "refused": True, "ok": True}
MATMUL = {"device": "NVIDIA H200", "tflops": 742.0, "peak": 989.4}


def test_a_passing_check_says_counts_engines_matmul_and_seconds():
    line, ok = device_check.summary_line({"passed": 40, "skipped": 3, "deselected": 34}, ONE_GPU, MATMUL, 212.4)
    assert ok
    assert line == ("device check: 40/0/3 gpu tests, 2-engine: skipped, 1 GPU; -n 2 on 1 GPU refused in one line, "
                    "bf16 matmul 742 TFLOP/s (75% of peak), 212 s")


@pytest.mark.parametrize("counts, note, two, failure", [
    ({"passed": 39, "failed": 1, "skipped": 3}, "", ONE_GPU, "FAILED: failed tests"),
    ({"passed": 39, "error": 1}, "", ONE_GPU, "FAILED: failed tests"),
    ({"skipped": 43}, "", ONE_GPU, "FAILED: no gpu test passed"),
    (None, "", ONE_GPU, "FAILED: pytest"),
    ({"passed": 12}, "pytest stopped at the check's wall limit, after 350 s, counted so far", ONE_GPU,
     "FAILED: pytest"),
    ({"passed": 40}, "", {"summary": "skipped, 1 GPU", "refused": False, "ok": False}, "FAILED: 2-engine"),
    ({"passed": 40}, "", None, "FAILED: 2-engine"),
])
def test_a_failing_check_says_what_failed_at_the_end_of_its_line(counts, note, two, failure):
    line, ok = device_check.summary_line(counts, two, MATMUL, 300, note)
    assert not ok and line.endswith(failure), line
    assert line.startswith("device check: ") and "\n" not in line, line
    if note:
        assert note in line, line


def test_an_unknown_gpu_or_a_missing_matmul_is_said_not_guessed():
    line, _ = device_check.summary_line({"passed": 1}, ONE_GPU, {"tflops": 300.0, "peak": None}, 1)
    assert "bf16 matmul 300 TFLOP/s (peak unknown)" in line
    line, _ = device_check.summary_line({"passed": 1}, ONE_GPU, None, 1)
    assert "bf16 matmul not measured" in line


def test_the_summary_reads_the_stages_files(tmp_path, capsys):
    (tmp_path / "pytest.log").write_text("....s\n4 passed, 1 skipped, 2 deselected in 80.1s (0:01:20)\n")
    (tmp_path / "two_engines.json").write_text('{"summary": "skipped, 1 GPU", "refused": true, "ok": true}')
    (tmp_path / "matmul.json").write_text('{"tflops": 700.0, "peak": 989.4}')
    assert device_check.main(["summary", str(tmp_path), "95"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        ("device check: 4/0/1 gpu tests, 2-engine: skipped, 1 GPU; -n 2 on 1 GPU refused in one line, "
         "bf16 matmul 700 TFLOP/s (71% of peak), 95 s")]
    (tmp_path / "pytest.log").write_text("....F\n")  # stopped at the wall limit
    (tmp_path / "pytest.note").write_text("pytest stopped at the check's wall limit, after 300 s\n")
    assert device_check.main(["summary", str(tmp_path), "440"]) == 1
    out = capsys.readouterr().out
    assert "4/1/0 gpu tests (pytest stopped at the check's wall limit, after 300 s, counted so far)" in out, out


# -- the 2-engine run's rank half, on the shared CPU cluster (the GPU machine has one GPU) ------------------------------


def on_rank_all_reduce(nbytes: int, reps: int) -> dict:
    """The script's rank half, called from this module (which the ranks import from the tests folder; scripts/ is
    no package they can import)."""
    return device_check.on_rank_all_reduce(nbytes, reps)


def test_the_two_engine_all_reduce_is_exact_and_timed(cluster):
    nbytes = 2**20
    ranks = cluster.run(on_rank_all_reduce, nbytes, 2, timeout=60)
    report = device_check.all_reduce_report(ranks, nbytes, want="cpu")
    assert report["exact"] and [r["device"] for r in ranks] == ["cpu", "cpu"], ranks
    assert report["busbw_gbs"] > 0 and report["summary"].startswith("ok on cpu, cpu, all-reduce "), report
    assert not device_check.all_reduce_report(ranks, nbytes)["exact"], "CPU ranks passed for CUDA ones"


# -- peaks ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, peak", [("NVIDIA H200", 989.4), ("NVIDIA H200 NVL", 835.5),
                                        ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.5),
                                        ("NVIDIA A100-SXM4-80GB", None)])
def test_the_peak_is_the_named_gpus_dense_bf16_figure(name, peak):
    assert device_check.peak_for(name) == peak


# -- the carried wheels -----------------------------------------------------------------------------------------------


def wheel(name: str, version: str = "1.0") -> str:
    """A wheel's file name, its distribution's name escaped as wheels write it (prompt_toolkit-3.0.53-...)."""
    return f"/w/{name.replace('-', '_')}-{version}-py3-none-any.whl"


def test_only_the_wheels_the_machine_lacks_are_installed():
    carried = [wheel(name) for name in device_check.CARRIED]
    here = {"pygments", "cloudpickle"}
    chosen, already, lacking = device_check.choose_wheels(carried, have=lambda name: device_check.canonical(name)
                                                          in here)
    assert already == sorted(here) and not lacking
    assert sorted(device_check.wheel_distribution(w) for w in chosen) == sorted(
        device_check.canonical(n) for n in device_check.CARRIED if device_check.canonical(n) not in here)


def test_a_missing_wheel_is_named_and_two_versions_of_one_are_refused():
    carried = [wheel(name) for name in device_check.CARRIED if name != "pyzmq"]
    assert device_check.choose_wheels(carried, have=lambda name: False)[2] == ["pyzmq"]
    with pytest.raises(ValueError, match="two wheels of tornado"):
        device_check.choose_wheels([wheel("tornado", "6.5"), wheel("tornado", "6.6.1")], have=lambda name: False)


def test_the_pins_are_this_venvs_versions_one_per_carried_wheel():
    pins = device_check.pins()
    names = [pin.split("==")[0] for pin in pins]
    assert names == list(device_check.CARRIED)
    for pin in pins:
        name, version = pin.split("==")
        try:
            assert version == importlib.metadata.version(name), pin
        except importlib.metadata.PackageNotFoundError:
            assert version == device_check.CARRIED[name], pin


def test_what_the_gpu_tests_import_is_carried_or_on_the_gpu_machine():
    """Each module the import check asks for comes from a carried distribution or one the GPU machine has (read in
    this venv, where all are installed), and nothing the GPU machine has is carried."""
    owners = importlib.metadata.packages_distributions()
    carried = {device_check.canonical(name) for name in device_check.CARRIED}
    for module in device_check.NEEDED_MODULES:
        dists = {device_check.canonical(d) for d in owners.get(module, [])}
        assert dists & (carried | ON_THE_GPU_MACHINE), f"{module} comes from {dists}: neither carried nor there"
    assert not carried & ON_THE_GPU_MACHINE
