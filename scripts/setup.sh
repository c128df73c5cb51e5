# Sourced by the other scripts: make .venv (once) and install nbdist with everything it needs, pip only.
# TORCH_SPEC picks the torch build (default: torch==2.13.0; TORCH_SPEC=torch for the newest).
# The first run takes a few minutes (torch is the largest download): each stage says what it does, and pip shows
# its own progress.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

stage() { printf '\n[nbdist set-up] %s\n' "$*"; }

if [ ! -x .venv/bin/python ]; then
    stage "creating .venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import nbdist, torch, nbclient" 2>/dev/null || [ pyproject.toml -nt .venv/.installed ]; then
    started=$SECONDS
    stage "1/3 upgrading pip"
    .venv/bin/python -m pip install --upgrade pip
    stage "2/3 installing $TORCH_SPEC (the largest part of the set-up)"
    .venv/bin/python -m pip install "$TORCH_SPEC"
    stage "3/3 installing nbdist (editable) with MPICH, mpi4py, ipyparallel, Jupyter, plotly and the test tools"
    .venv/bin/python -m pip install -e ".[test]"
    touch .venv/.installed
    stage "done in $((SECONDS - started)) s: .venv is ready"
fi
export PATH="$PWD/.venv/bin:$PATH"
# The venv's own python3 kernel first, whatever kernels the user has installed elsewhere.
export JUPYTER_PATH="$PWD/.venv/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
