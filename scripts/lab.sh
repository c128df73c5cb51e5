#!/usr/bin/env bash
# Open the notebooks in JupyterLab, running from the project's .venv (set up on first use, JupyterLab included).
# Extra arguments go to `jupyter lab`, e.g.:  bash scripts/lab.sh --no-browser --port 8899
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if ! python -c "import jupyterlab" 2>/dev/null; then  # a .venv set up before JupyterLab joined the test tools
    printf '\n[nbdist] installing JupyterLab into .venv (first use only)\n'
    python -m pip install "jupyterlab>=4.2"
fi
exec jupyter lab notebooks "$@"
