#!/usr/bin/env bash
# The test command: set up (apt + venv), lint, type-check, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
bash scripts/typecheck.sh
pytest -q "$@"
