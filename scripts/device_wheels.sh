#!/usr/bin/env bash
# Download into .whl/ the wheels scripts/device_check.sh installs on the GPU machine, which reaches no package
# registry. Run it here (where pip reaches PyPI), then carry .whl (ignored by git) with the working tree.
# What is carried and why: CARRIED in scripts/device_check.py (ipyparallel's dependency closure, cloudpickle, the
# Trainer dashboard's widgets and plotly, the mpich wheel; not torch, mpi4py, nvidia-ml-py or the rest the GPU machine
# has). Versions: this project's .venv's where it has them. Platform: the GPU machine's, CPython 3.12 on manylinux
# x86-64, whatever this machine is.
# Prints each wheel and the total size, beside the tracked files': together they must stay well under the 64 MiB
# the device tool carries.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3

mapfile -t PINS < <("$PYTHON" scripts/device_check.py pins)
PLATFORMS=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done

fresh=$(mktemp -d)
trap 'rm -rf "$fresh"' EXIT
echo "downloading ${#PINS[@]} wheels for CPython 3.12, manylinux x86-64: ${PINS[*]}"
"$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$fresh" "${PINS[@]}"
rm -rf .whl
mv "$fresh" .whl
trap - EXIT

ls -l .whl | awk 'NR > 1 {printf "  %8.1f KiB  %s\n", $5 / 1024, $9}'
wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
awk -v w="$wheels" -v t="$tracked" -v n="$(ls .whl | wc -l)" 'BEGIN {
    printf ".whl/: %d wheels, %.1f MiB; tracked files %.1f MiB; ", n, w / 2^20, t / 2^20
    printf "together %.1f MiB of the 64 MiB the device tool carries\n", (w + t) / 2^20 }'
