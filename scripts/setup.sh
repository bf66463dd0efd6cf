#!/usr/bin/env bash
# Install everything this project needs on a fresh Debian/Ubuntu machine into ./.venv.
# Idempotent: re-running only installs what is missing. Never pulls a CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
# The repo-root folder operator/ would shadow the stdlib module `operator` whenever Python puts
# the working directory on sys.path (python -m ...). Never let it.
export PYTHONSAFEPATH=1

APT_PKGS=(redis-server)
missing=()
for p in "${APT_PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
