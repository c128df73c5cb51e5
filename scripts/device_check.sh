#!/usr/bin/env bash
# The GPU check in one command (issue 20): bash scripts/device_check.sh
#
# Why: the tests marked `gpu` (the CUDA cases of the files that mark them) only mean something on a GPU machine, and
# the one this project borrows is lent for minutes, reaches no package registry, and has torch with CUDA, mpi4py and
# nvidia-ml-py but not ipyparallel, Jupyter or an MPI runtime. So this script, in under 8 minutes:
#   1. says in one line, and exits 0, where there is no CUDA (CUDA_VISIBLE_DEVICES empty or -1, no nvidia-smi, no GPU
#      listed, or torch without CUDA);
#   2. installs, from the wheels carried in .whl/ (scripts/device_wheels.sh downloads them), what the machine lacks,
#      into $NBDIST_DEVICE_PREFIX (/tmp/site), with the `mpich` wheel's mpiexec and libmpi for nbdist and mpi4py;
#   3. measures bf16 matmul TFLOP/s on cuda:0 against the GPU's dense peak (scripts/device_check.py);
#   4. runs the gpu tests (pytest -m gpu, a timeout per test where pytest-timeout is there, and a wall limit);
#   5. runs 2 engines where there are 2 GPUs (an exact all_reduce, NCCL's all-reduce bus bandwidth); with one GPU it
#      says why not, and checks that nbdist refuses -n 2 there in one line (NCCL runs one rank per GPU);
#   6. prints one summary line: passed/failed/skipped gpu tests, the 2-engine run, the matmul figure, the seconds.
# Exit status: 0 if no CUDA, or if every gpu test passed or skipped (at least one passed) and the 2-engine stage did
# what it must; 1 otherwise. The full log goes to $OUT/device_check.log when $OUT is set (the device tool's folder),
# else to a temporary folder it names.
# Settings: PYTHON (python3), NBDIST_DEVICE_PREFIX (/tmp/site, emptied first), NBDIST_DEVICE_CHECK_SECONDS (450).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
START=$SECONDS
PY=${PYTHON:-python3}
LIMIT=${NBDIST_DEVICE_CHECK_SECONDS:-450}  # the whole check, in seconds: under 8 minutes with the kill grace
PER_TEST_TIMEOUT=240                        # pytest-timeout's limit for one test, its fixtures included

left() { echo $((LIMIT - (SECONDS - START))); }
at_most() {  # seconds for a stage: $1, or what is left of LIMIT if less (10 at least: it still says something)
    local budget; budget=$(left)
    budget=$((budget < $1 ? budget : $1))
    echo $((budget < 10 ? 10 : budget))
}

# -- 1. CUDA at all? --------------------------------------------------------------------------------------------------
no_cuda() {
    echo "device check: no CUDA here ($1); nothing to check"
    exit 0
}
case "${CUDA_VISIBLE_DEVICES-unset}" in
    "" | -1) no_cuda "CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES}' hides every GPU" ;;
esac
command -v nvidia-smi >/dev/null 2>&1 || no_cuda "nvidia-smi not found"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
[ "${GPUS:-0}" -gt 0 ] || no_cuda "nvidia-smi lists no GPU"
command -v "$PY" >/dev/null 2>&1 || no_cuda "nvidia-smi lists $GPUS GPU(s), but there is no $PY to run torch"
probe=$(timeout 120 "$PY" -c 'import torch; print(torch.cuda.is_available(), torch.__version__, torch.version.cuda)' \
    2>&1 | tail -1; exit "${PIPESTATUS[0]}")
[ $? = 124 ] && probe="importing torch took over 120 s"
case "$probe" in
    True*) ;;
    *) no_cuda "nvidia-smi lists $GPUS GPU(s), but torch.cuda.is_available() is not True: ${probe:0:200}" ;;
esac

RESULTS=${OUT:+$OUT/device_check}
RESULTS=${RESULTS:-$(mktemp -d -t nbdist-device-check.XXXXXX)}
mkdir -p "$RESULTS"
LOG=${OUT:+$OUT/device_check.log}
LOG=${LOG:-$RESULTS/device_check.log}
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }
say "device check: $GPUS GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs);" \
    "torch $(echo "$probe" | cut -d' ' -f2) (CUDA $(echo "$probe" | cut -d' ' -f3)); log: $LOG"

# -- 2. what the machine lacks, from .whl/ ----------------------------------------------------------------------------
PREFIX=${NBDIST_DEVICE_PREFIX:-/tmp/site}
SITE="" MPI_PREFIX=""
if compgen -G ".whl/*.whl" >/dev/null; then
    rm -rf "$PREFIX"
    assignments=$(timeout "$(at_most 180)" "$PY" scripts/device_check.py install .whl "$PREFIX" \
        2>"$RESULTS/install.err")
    status=$?
    cat "$RESULTS/install.err" >>"$LOG"
    if [ $status -ne 0 ]; then
        tail -1 "$RESULTS/install.err"
        exit 1
    fi
    tail -1 "$RESULTS/install.err"
    while IFS='=' read -r key value; do
        case "$key" in SITE) SITE=$value ;; MPI_PREFIX) MPI_PREFIX=$value ;; esac
    done <<<"$assignments"
    # Byte-compile once here (16 cores, seconds) rather than in every engine, controller and kernel that imports it.
    [ -n "$SITE" ] && timeout "$(at_most 120)" "$PY" -m compileall -q -j 0 "$SITE" >>"$LOG" 2>&1
fi
export PYTHONPATH="${SITE:+$SITE:}$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$MPI_PREFIX" ]; then  # the carried mpich: its mpiexec for nbdist, its libmpi for mpi4py (theirs must match)
    export PATH="$MPI_PREFIX/bin:$PATH"
    export LD_LIBRARY_PATH="$MPI_PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export MPI4PY_LIBMPI="$MPI_PREFIX/lib/libmpi.so.12" NBDIST_MPIEXEC="$MPI_PREFIX/bin/mpiexec"
fi
if ! imports=$(timeout "$(at_most 120)" "$PY" scripts/device_check.py imports 2>>"$LOG"); then
    say "${imports:-device check: the import check failed (see $LOG)}"
    exit 1
fi
say "$imports"

# -- 3. bf16 matmul ---------------------------------------------------------------------------------------------------
timeout -k 5 "$(at_most 90)" "$PY" scripts/device_check.py matmul "$RESULTS" 2>>"$LOG" | tee -a "$LOG" \
    || say "bf16 matmul: failed (see $LOG)"

# -- 4. the gpu tests -------------------------------------------------------------------------------------------------
# The files that mark gpu tests, tests/test_gpu*.py first (the engine and its collectives before the paths using them).
mapfile -t FILES < <(printf '%s\n' tests/test_gpu*.py tests/test_*.py | awk '!seen[$0]++' \
    | xargs grep -l -E 'pytest\.mark\.gpu|from gpu_engines import')
RESERVE=$((GPUS >= 2 ? 180 : 40))  # for the 2-engine stage and the summary
BUDGET=$(at_most $(($(left) - RESERVE)))
TIMEOUT_ARGS=()
"$PY" -c 'import pytest_timeout' 2>/dev/null && TIMEOUT_ARGS=(--timeout="$PER_TEST_TIMEOUT")
say "gpu tests: pytest -m gpu ${FILES[*]} (at most $BUDGET s${TIMEOUT_ARGS:+, $PER_TEST_TIMEOUT s a test})"
timeout -k 10 "$BUDGET" "$PY" -m pytest -m gpu -q -p no:cacheprovider --tb=short "${TIMEOUT_ARGS[@]}" "${FILES[@]}" \
    2>&1 | tee "$RESULTS/pytest.log"
status=${PIPESTATUS[0]}
cat "$RESULTS/pytest.log" >>"$LOG"
case $status in
    124 | 137) echo "pytest stopped at the check's wall limit, after $BUDGET s" >"$RESULTS/pytest.note" ;;
esac

# -- 5. two engines ---------------------------------------------------------------------------------------------------
timeout -k 5 "$(at_most $((RESERVE - 10)))" "$PY" scripts/device_check.py two-engines "$RESULTS" 2>>"$LOG" \
    | tee -a "$LOG"

# -- 6. the summary ---------------------------------------------------------------------------------------------------
"$PY" scripts/device_check.py summary "$RESULTS" $((SECONDS - START)) | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
