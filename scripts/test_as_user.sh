#!/usr/bin/env bash
# The tests that start clusters, run by an ordinary Unix user, as nbdist's users are (CI runs everything else as
# root). Run as root: it makes the user (NBDIST_TEST_USER, default nbdist-learner), clones this checkout's commit
# into their home, and there, as that user, sets up a venv the README's way (scripts/setup.sh) on the system's own
# Python (NBDIST_USER_PYTHON, default /usr/bin/python3: Debian 12's 3.11.2; root's Python may lie in a folder the user
# cannot enter), then runs:
#   one host, forked and fresh ranks; %%dist in a real kernel; the stepper; the hang view; a Trainer fit with a
#   checkpoint and a resume; the cluster's privacy (the probes that need root skip there, saying so).
# The multi-host tests make their hosts as network namespaces, which needs root: they run in the root job only.
#   scripts/test_as_user.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/test_as_user.sh makes a user and becomes them: run it as root (CI does)" >&2
    exit 1
fi
LEARNER=${NBDIST_TEST_USER:-nbdist-learner}
LEARNER_PYTHON=${NBDIST_USER_PYTHON:-/usr/bin/python3}
id -u "$LEARNER" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$LEARNER"
LEARNER_HOME=$(getent passwd "$LEARNER" | cut -d: -f6)
CHECKOUT="$LEARNER_HOME/nbdist"
if [ ! -d "$CHECKOUT/.git" ]; then
    git clone --quiet "$PWD" "$CHECKOUT"
fi
AS_ROOT=(git -c safe.directory="$CHECKOUT" -C "$CHECKOUT")  # root works in the user's clone: git must be told
"${AS_ROOT[@]}" fetch --quiet "$PWD" HEAD
"${AS_ROOT[@]}" checkout --quiet --force FETCH_HEAD  # this checkout's commit (its .venv is kept between runs)
chown -R "$LEARNER": "$CHECKOUT"

TESTS=(
    tests/test_cluster.py tests/test_warm_start.py tests/test_start_interrupted.py tests/test_cluster_folder.py
    tests/test_one_host_privacy.py tests/test_exposure.py tests/test_magics.py tests/test_hang_view.py
    "tests/test_pipeline.py::test_stepper_runs_tick_by_tick_to_the_same_result"
    "tests/test_trainer.py::test_interrupted_and_resumed_ends_where_an_uninterrupted_run_does"
    "tests/test_trainer.py::test_resume_on_another_plan_and_engine_count_reshards"
    tests/test_checkpoint_metadata.py
    # models nbdist did not write (Hugging Face's Llama and BERT, a CNN with BatchNorm), trained as one process does
    "tests/test_user_models_training.py::test_a_hugging_face_llama_trains_on_its_own_loss_like_one_process"
    "tests/test_user_models_training.py::test_a_bert_classifier_trains_through_a_pipeline_like_one_process"
    "tests/test_user_models_training.py::test_a_batchnorm_cnn_trains_like_one_process_with_synchronised_batchnorm"
)
# Only what the user's own session would have: their home, the system's PATH, pip's settings of this machine.
KEEP=(HOME="$LEARNER_HOME" USER="$LEARNER" LOGNAME="$LEARNER" PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8)
for name in PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_CERT PIP_DEFAULT_TIMEOUT TORCH_SPEC; do
    if [ -n "${!name:-}" ]; then KEEP+=("$name=${!name}"); fi
done
echo "[nbdist as $LEARNER] $(setpriv --reuid="$LEARNER" --regid="$LEARNER" --init-groups id)"
exec setpriv --reuid="$LEARNER" --regid="$LEARNER" --init-groups env -i "${KEEP[@]}" \
    bash -c 'cd ~/nbdist && export PYTHON="$0" && source scripts/setup.sh && python -m pytest -q -p no:cacheprovider "$@"' \
    "$LEARNER_PYTHON" "${TESTS[@]}" "$@"
