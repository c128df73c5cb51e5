#!/usr/bin/env bash
# Set up (first run only) and run the tests.
#   scripts/test.sh             every test: unit tests, real MPI clusters, magics in a real kernel, notebooks, browser,
#                               hosts (in two streams at first: below)
#   scripts/test.sh fast        only the tests that start no MPI engine, browser or notebook, need no GPU and no other
#                               host, and take under a second each: the markers tests/conftest.py sets; under a
#                               minute on 2 cores
#   scripts/test.sh ARGS...     ARGS go to pytest as they are (e.g. -k pipeline, -m "cluster and not notebook"), in one
#                               process
# `scripts/test.sh fast ARGS...` passes ARGS on too; so does the whole suite for ARGS that only ask for durations.
#
# The whole suite runs in two streams side by side, then the rest. The tests of other hosts (network-namespace hosts
# with sshd and Slurm daemons) spend most of their time waiting: for a host to be named lost, a node to be set DOWN, a
# lifeline to time out. They run beside the tests that check results, not times (parallel equals serial, torch's own
# distributed tests, the planner's tables and figures, bad inputs), which keep the cores busy; after them in the
# same stream come the fast unit tests of every other file, the classroom (three learners' servers under a
# JupyterHub: privacy probes and culling, its alone-beside-others ratio only printed) and the Binder environment's
# quick start.
# Everything that times something or watches the whole machine (notebooks, the browser, the labs' measurements) runs
# after, alone. Measured on 2 cores with other work running: the two streams side by side 367 s, both passing, against
# 181 + 267 s one after the other in the whole suite before.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if [ "${1:-}" = fast ]; then
    shift
    exec python -m pytest -q tests -m fast "$@"
fi
for arg in "$@"; do
    case "$arg" in --durations=*) ;; *) exec python -m pytest -q tests "$@" ;; esac
done

HOSTS=(tests/test_hosts_*.py tests/test_lifeline_hosts.py)
RESULTS=(tests/test_torch_distributed.py tests/test_sharding.py tests/test_user_models.py
         tests/test_user_models_training.py tests/test_cluster_planner.py tests/test_collective_algorithms.py
         tests/test_pipeline_gpu_rules.py tests/test_bad_inputs.py tests/test_pipeline.py
         tests/test_trainer_bad_inputs.py tests/test_pipeline_fifo.py tests/test_pipeline_mesh.py
         tests/test_bad_inputs_user_models.py tests/test_bad_inputs_sharding.py tests/test_lab40_figures.py)
BESIDE=(tests/test_classroom.py tests/test_binder.py)  # after the hosts, in their stream
IGNORED=()
for file in "${HOSTS[@]}" "${RESULTS[@]}" "${BESIDE[@]}"; do IGNORED+=("--ignore=$file"); done
mkdir -p out
HOSTS_LOG=out/tests-hosts.log
echo "== 1 of 3 (beside 2): the tests of other hosts, the fast unit tests, the classroom; their output follows" \
     "stream 2's (also in $HOSTS_LOG)"
(
    beside=0
    python -m pytest -q "${HOSTS[@]}" "$@" || beside=$?
    python -m pytest -q tests -m fast "${IGNORED[@]}" "$@" || beside=$?
    python -m pytest -q "${BESIDE[@]}" "$@" || beside=$?
    exit $beside
) >"$HOSTS_LOG" 2>&1 &
hosts_pid=$!
echo "== 2 of 3: the tests that check results, not times, beside the tests of other hosts"
status=0
python -m pytest -q "${RESULTS[@]}" "$@" || status=$?
wait "$hosts_pid" || status=$?
echo "== 1 of 3: the tests of other hosts, the fast unit tests, the classroom"
cat "$HOSTS_LOG"
echo "== 3 of 3: everything else, alone on the machine"
python -m pytest -q tests -m "not fast" "${IGNORED[@]}" "$@" || status=$?
exit $status
