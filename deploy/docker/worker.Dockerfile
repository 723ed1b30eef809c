# syntax=docker/dockerfile:1
# The probewire stream worker (Faust): reads per-rank summaries from Kafka, writes ClickHouse.
# The same image runs the ClickHouse schema migration (`probewire migrate`) in the chart's hook Job.
#
# Build from the repository root (the build context must hold pyproject.toml):
#   docker build -f deploy/docker/worker.Dockerfile -t probewire/worker:0.1.0 .
# BuildKit reads deploy/docker/worker.Dockerfile.dockerignore for this build.
#
# torch==2.13.0 is pinned by the package. TORCH_INDEX_URL is searched in addition to PyPI;
# the default CPU index serves torch 2.13.0+cpu, which pip prefers over PyPI's CUDA build of
# the same version and which is far smaller. For a CUDA image pass the matching index,
# e.g. --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INPUT=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY instrument ./instrument
COPY stream ./stream
COPY sinks ./sinks
COPY evaluators ./evaluators
COPY deploy ./deploy
RUN python -m venv /opt/probewire \
 && /opt/probewire/bin/pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" .

FROM ${PYTHON_IMAGE}
# A fixed non-root user; the Helm chart runs the pods as 10001:10001.
RUN groupadd --system --gid 10001 probewire \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/probewire --no-create-home \
      --shell /usr/sbin/nologin probewire \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/probewire /tmp/probewire
COPY --from=build /opt/probewire /opt/probewire
# Nothing is written outside /tmp and the working directory, so the root filesystem can be
# read-only (the chart mounts emptyDirs at both).
ENV PATH=/opt/probewire/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    XDG_CACHE_HOME=/tmp/.cache
WORKDIR /var/lib/probewire
USER 10001:10001
# Healthy while the heartbeat file the service rewrites every few seconds is fresh.
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["probewire", "health", "--component", "worker"]
ENTRYPOINT ["probewire"]
CMD ["worker"]
