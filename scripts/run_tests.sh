#!/usr/bin/env bash
# Every test, in two phases, within CI's 25-minute budget on 2 cores (needs the venv active).
#
# Phase 1, side by side:
#   - the unit tests: one pytest process, pure computation, about one core (then AFTER_UNIT);
#   - the real-engine e2e modules (SGLang, vLLM), most of whose time is their servers'
#     start-up, then tests that time nothing (BESIDE: store and start-up integration tests,
#     the dashboard's metric names against a live cluster).
#   BESIDE and AFTER_UNIT are integration tests that time nothing, split so that both sides
#   end together.
#   None has a deadline that a busy box can miss, and they share nothing but the model cache
#   (converted once, below, before either starts).
# Phase 2, alone: the e2e and integration tests of our own processes, whose faults (deadlines,
# partitions, leases, frozen processes) are timed against a box that has its cores to itself.
# Each phase prints its slowest tests; the exit status is non-zero when any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1
ENGINES=(tests/e2e/test_sglang.py tests/e2e/test_vllm.py)
BESIDE=(tests/integration/store/test_bind_guard_procs.py tests/integration/store/test_space_puts_procs.py
        tests/integration/test_startup_errors_procs.py tests/e2e/test_dashboard.py)
AFTER_UNIT=(tests/integration/store/test_store_cluster.py)  # balances the two (measured)
work=$(mktemp -d "${TMPDIR:-/tmp}/mooncake-tests.XXXXXX")
trap 'rm -rf "$work"' EXIT

python -c "from mooncake_k8s.engine.loading import ensure_builtin; ensure_builtin(progress=False)"

start=$SECONDS
pytest -q -p no:cacheprovider --basetemp "$work/unit" --durations=15 tests/unit \
  "${AFTER_UNIT[@]}" > "$work/unit.log" 2>&1 &
unit_pid=$!
pytest -q -p no:cacheprovider --basetemp "$work/engines" --durations=15 "${ENGINES[@]}" \
  "${BESIDE[@]}" > "$work/engines.log" 2>&1
engines_rc=$?
wait "$unit_pid"
unit_rc=$?
echo "=== phase 1: unit tests (rc $unit_rc) beside the engine e2e modules and BESIDE (rc $engines_rc)," \
  "$((SECONDS - start)) s"
echo "--- unit tests"
cat "$work/unit.log"
echo "--- engine e2e modules, then BESIDE"
cat "$work/engines.log"

start=$SECONDS
echo "=== phase 2: e2e and integration tests of our own processes"
ignores=()
for f in "${ENGINES[@]}" "${BESIDE[@]}" "${AFTER_UNIT[@]}"; do ignores+=(--ignore "$f"); done
pytest -q --durations=30 tests/e2e tests/integration "${ignores[@]}"
rest_rc=$?
echo "=== phase 2 (rc $rest_rc): $((SECONDS - start)) s"

[ "$unit_rc" -eq 0 ] && [ "$engines_rc" -eq 0 ] && [ "$rest_rc" -eq 0 ]
