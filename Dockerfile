# syntax=docker/dockerfile:1
# One image for every role: the `mooncake` CLI (conductor, prefill, decode, store master and
# node, rdma-probe) and the operator. Build: docker build -t mooncake-k8s:0.1.0 .
# Extras: --build-arg EXTRAS=operator,<engine extra> adds the engine's dependencies once its
# extra exists; --build-arg WITH_RDMA=true adds rdma-core and pyverbs for the RDMA transport.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG EXTRAS=operator
ARG WITH_RDMA=false
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONSAFEPATH=1
RUN if [ "$WITH_RDMA" = "true" ]; then \
      apt-get update && apt-get install -y --no-install-recommends \
        build-essential cmake libibverbs-dev librdmacm-dev pkg-config \
      && rm -rf /var/lib/apt/lists/*; \
    fi
RUN python -m venv /opt/mooncake && /opt/mooncake/bin/pip install --upgrade pip wheel
WORKDIR /src
# Dependencies first (cached across source edits), then the package itself.
COPY pyproject.toml README.md ./
COPY services ./services
COPY operator ./operator
RUN /opt/mooncake/bin/pip install ".[${EXTRAS}]" \
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
