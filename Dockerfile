# syntax=docker/dockerfile:1
#
# gpu-alloc-exporter container image.
#
#   docker build -t gpu-alloc-exporter:0.1.0 .
#   docker run --rm --read-only -p 19402:19402 gpu-alloc-exporter:0.1.0 demo --web.listen-address 0.0.0.0:19402
#
# Multi-stage: the build stage creates a virtual environment in /opt/gpu-alloc-exporter (pinned
# dependencies first, for layer caching, then the exporter itself); the runtime stage copies only
# that environment onto the same slim base. The runtime stage runs as a fixed non-root uid, writes
# nothing (read-only root filesystem ready) and is configured through GPU_ALLOC_EXPORTER_*
# environment variables or flags. See docs/deploy.md.
#
# The base image is pinned by tag. For production builds pin it by digest as well, e.g.
#   docker buildx imagetools inspect python:3.11-slim-bookworm   # prints the index digest
#   docker build --build-arg BASE_IMAGE=python:3.11-slim-bookworm@sha256:<digest> .
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

RUN python -m venv /opt/gpu-alloc-exporter

# Dependencies change rarely: their own layer, installed from exact pins.
COPY deploy/docker/requirements.txt /tmp/requirements.txt
RUN /opt/gpu-alloc-exporter/bin/pip install --no-cache-dir --requirement /tmp/requirements.txt

WORKDIR /src
COPY pyproject.toml README.md ./
COPY exporter ./exporter
# --no-deps: everything it needs is already pinned above; `pip check` proves the set is complete.
# Bytecode is compiled here, so the read-only runtime never needs to write any; unchecked-hash
# .pyc files stay valid whatever timestamps the copy into the runtime stage gives the sources.
RUN /opt/gpu-alloc-exporter/bin/pip install --no-cache-dir --no-deps . \
    && /opt/gpu-alloc-exporter/bin/pip check \
    && /opt/gpu-alloc-exporter/bin/python -m compileall -q --invalidation-mode unchecked-hash /opt/gpu-alloc-exporter/lib \
    && /opt/gpu-alloc-exporter/bin/gpu-alloc-exporter --version


FROM ${BASE_IMAGE}

ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown

LABEL org.opencontainers.image.title="gpu-alloc-exporter" \
      org.opencontainers.image.description="Prometheus exporter for live GPU allocation of Backend.AI kernels (fGPU shares, whole GPUs, MIG) with NVML telemetry" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11-slim-bookworm"

# A fixed, unprivileged uid/gid (65532, the conventional "nonroot"), so that Kubernetes'
# runAsUser, host file permissions and supplementary groups can name it.
RUN groupadd --system --gid 65532 gpu-alloc-exporter \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin gpu-alloc-exporter

COPY --from=build /opt/gpu-alloc-exporter /opt/gpu-alloc-exporter
COPY deploy/docker/healthcheck.py /opt/gpu-alloc-exporter/libexec/healthcheck.py

# PYTHONDONTWRITEBYTECODE: the root filesystem is read-only at runtime (bytecode was compiled at
# build time). NVIDIA_*: what the NVIDIA container runtime injects when the container runs with it:
# every GPU, and only the NVML "utility" libraries. Set NVIDIA_VISIBLE_DEVICES=void to opt out.
# No GPU_ALLOC_EXPORTER_* variable is set here on purpose: the environment outranks
# --config.file, so an image default would silently override a mounted configuration file.
ENV PATH=/opt/gpu-alloc-exporter/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility

USER 65532:65532
EXPOSE 19402

HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "/opt/gpu-alloc-exporter/libexec/healthcheck.py"]

ENTRYPOINT ["gpu-alloc-exporter"]
