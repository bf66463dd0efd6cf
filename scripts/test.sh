#!/usr/bin/env bash
# The test command: set up (apt + venv), lint, type-check, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
# The repo-root folder operator/ would shadow the stdlib module `operator` whenever Python puts
# the working directory on sys.path (python -m ...). Never let it.
export PYTHONSAFEPATH=1
# The tests run real vLLM and SGLang workers: install both (CPU builds) and fail, not skip,
# without them.
export MOONCAKE_WITH_VLLM=1 MOONCAKE_REQUIRE_VLLM=1
export MOONCAKE_WITH_SGLANG=1 MOONCAKE_REQUIRE_SGLANG=1
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
bash scripts/typecheck.sh
if [ "$#" -gt 0 ]; then  # a chosen set of tests: one plain run
  exec pytest -q --durations=40 "$@"
fi
exec bash scripts/run_tests.sh
