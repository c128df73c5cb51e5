#!/usr/bin/env bash
# Set up (first run only) and run the tests.
#   scripts/test.sh             every test: unit tests, real MPI clusters, magics in a real kernel, notebooks, browser
#   scripts/test.sh fast        only the tests that start no MPI engine, browser or notebook, need no GPU and no other
#                               host, and take under a second each: the markers tests/conftest.py sets; under a
#                               minute on 2 cores
#   scripts/test.sh ARGS...     ARGS go to pytest as they are (e.g. -k pipeline, -m "cluster and not notebook")
# `scripts/test.sh fast ARGS...` passes ARGS on too.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if [ "${1:-}" = fast ]; then
    shift
    exec python -m pytest -q tests -m fast "$@"
fi
exec python -m pytest -q tests "$@"
