#!/usr/bin/env bash
# Every test, in two phases, within CI's 25-minute budget on 2 cores (needs the venv active).
#
# Phase 1, side by side:
#   - the unit tests: one pytest process, pure computation, about one core;
#   - the real-engine e2e modules (SGLang, vLLM): most of their time is their servers' start-up.
#   Neither has a deadline that a busy box can miss, and they share nothing but the model cache
#   (converted once, below, before either starts).
# Phase 2, alone: the e2e and integration tests of our own processes, whose faults (deadlines,
# partitions, leases, frozen processes) are timed against a box that has its cores to itself.
# Each phase prints its slowest tests; the exit status is non-zero when any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1
ENGINES=(tests/e2e/test_sglang.py tests/e2e/test_vllm.py)
work=$(mktemp -d "${TMPDIR:-/tmp}/mooncake-tests.XXXXXX")
trap 'rm -rf "$work"' EXIT

python -c "from mooncake_k8s.engine.loading import ensure_builtin; ensure_builtin(progress=False)"

start=$SECONDS
pytest -q -p no:cacheprovider --basetemp "$work/unit" --durations=15 tests/unit \
  > "$work/unit.log" 2>&1 &
unit_pid=$!
pytest -q -p no:cacheprovider --basetemp "$work/engines" --durations=15 "${ENGINES[@]}" \
  > "$work/engines.log" 2>&1
engines_rc=$?
wait "$unit_pid"
unit_rc=$?
echo "=== phase 1: unit tests (rc $unit_rc) beside the engine e2e modules (rc $engines_rc)," \
  "$((SECONDS - start)) s"
echo "--- unit tests"
cat "$work/unit.log"
echo "--- engine e2e modules"
cat "$work/engines.log"

start=$SECONDS
echo "=== phase 2: e2e and integration tests of our own processes"
ignores=()
for f in "${ENGINES[@]}"; do ignores+=(--ignore "$f"); done
pytest -q --durations=30 tests/e2e tests/integration "${ignores[@]}"
rest_rc=$?
echo "=== phase 2 (rc $rest_rc): $((SECONDS - start)) s"

[ "$unit_rc" -eq 0 ] && [ "$engines_rc" -eq 0 ] && [ "$rest_rc" -eq 0 ]
