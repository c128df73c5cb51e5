#!/usr/bin/env bash
# Set up (first run only) and run every test: unit tests, real MPI clusters, magics in a real kernel, notebooks.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
python -m pytest -q tests "$@"
