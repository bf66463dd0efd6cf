#!/usr/bin/env bash
# The main job: install, start the whole system with `mooncake up` (master, storage node,
# prefill, decode, Conductor; the embedded SmolLM2-135M-Instruct), send a sample chat request,
# and keep serving until Ctrl-C. PORT (default 8000) picks the OpenAI endpoint's port.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1
bash scripts/setup.sh
PORT=${PORT:-8000}
.venv/bin/mooncake up --port "$PORT" &
UP=$!
trap 'kill -INT $UP 2>/dev/null; wait $UP' INT TERM EXIT
until curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null; do
  kill -0 $UP 2>/dev/null || { echo "mooncake up exited early" >&2; exit 1; }
  sleep 1
done
echo "--- sample request: POST /v1/chat/completions"
curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "SmolLM2-135M-Instruct", "max_tokens": 48, "temperature": 0,
       "messages": [{"role": "user", "content": "What is the capital of France?"}]}' \
  | .venv/bin/python -m json.tool
echo "--- serving on http://127.0.0.1:$PORT/v1 ; Ctrl-C stops everything"
wait $UP
