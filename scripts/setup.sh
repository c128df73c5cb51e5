# Sourced by the other scripts: make .venv (once) and install nbdist with everything it needs, pip only.
# TORCH_SPEC picks the torch build (default: the CPU build 2.13.0; an unpinned torch pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import nbdist, torch, nbclient" 2>/dev/null || [ pyproject.toml -nt .venv/.installed ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
    .venv/bin/python -m pip install -q -e ".[test]"
    touch .venv/.installed
fi
export PATH="$PWD/.venv/bin:$PATH"
# The venv's own python3 kernel first, whatever kernels the user has installed elsewhere.
export JUPYTER_PATH="$PWD/.venv/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
