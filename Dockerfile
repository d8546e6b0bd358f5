# syntax=docker/dockerfile:1
# Conveyor image: one image for every service (`conveyor router|scheduler|worker|models|health`).
#
#   docker build -t conveyor:latest .                                   # CPU (default)
#   docker build -t conveyor:cuda --build-arg BASE=cuda .               # CUDA 12.8 + NCCL + Triton
#   docker build --build-arg TORCH_INDEX_URL=https://mirror.example/whl/cpu .  # another index
#   pip download torch==2.13.0 --no-deps -d wheels                      # torch from a folder of
#   docker build --build-arg TORCH_WHEELS=wheels .                      # wheels, no torch download
#
# No model is baked in: models live in a volume mounted at /models
# (`conveyor models fetch smollm2-135m --dir /models`). Redis runs in its own container.

# cpu | cuda: which base (and torch build) the final image uses.
ARG BASE=cpu
# Where pip gets torch: a package index URL; empty = PyTorch's index for BASE (CPU or CUDA 12.8).
ARG TORCH_INDEX_URL=""
# Or a folder holding the torch wheel: relative = inside the build context; absolute = a folder
# the builder mounts (`podman build -v DIR:/wheels:ro --build-arg TORCH_WHEELS=/wheels`). Torch
# comes from there, its dependencies (filelock, sympy, ...) from PyPI, or TORCH_INDEX_URL if set.
ARG TORCH_WHEELS=""
ARG PYTHON_IMAGE=python:3.11-slim
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# ---- bases: the Python runtime, and where torch and which extras come from ----
FROM ${PYTHON_IMAGE} AS base-cpu
# g++: the workers' C++ decode-attention kernel (built below; rebuilt only if its source changes)
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
ENV DEFAULT_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
    CONVEYOR_EXTRAS="" \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions

FROM ${CUDA_IMAGE} AS base-cuda
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
ENV DEFAULT_TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
    CONVEYOR_EXTRAS="cuda" \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions

# ---- build: a virtualenv with torch first (pinned, from the chosen index), then Conveyor ----
FROM base-${BASE} AS build
ARG TORCH_VERSION=2.13.0
# build args, not ENV: an ENV of the same name would silently win over --build-arg
ARG TORCH_INDEX_URL
ARG TORCH_WHEELS
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Its own layer: torch is the big download and changes least often.
RUN --mount=type=bind,target=/context \
    case "${TORCH_WHEELS}" in \
      "") from="--index-url ${TORCH_INDEX_URL:-${DEFAULT_TORCH_INDEX_URL}}" ;; \
      /*) from="--find-links ${TORCH_WHEELS}" ;; \
      *) from="--find-links /context/${TORCH_WHEELS}" ;; \
    esac \
    && if [ -n "${TORCH_WHEELS}" ] && [ -n "${TORCH_INDEX_URL}" ]; then \
         from="${from} --index-url ${TORCH_INDEX_URL}"; fi \
    && pip install ${from} "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services ./services
RUN if [ -n "${CONVEYOR_EXTRAS}" ]; then pip install ".[${CONVEYOR_EXTRAS}]"; else pip install .; fi \
    && conveyor --help >/dev/null
# Compile the CPU kernels now, so that CPU workers start without a build of up to a minute.
RUN mkdir -p "${TORCH_EXTENSIONS_DIR}" \
    && if [ -z "${CONVEYOR_EXTRAS}" ]; then cd / && python -m services.worker.prebuild; fi

# ---- runtime: the virtualenv, a non-root user, an empty /models ----
FROM base-${BASE} AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=10001:10001 /opt/torch_extensions /opt/torch_extensions
# /models (and /certs, docker-compose.tls.yml) are owned by the service user so that a fresh
# named volume mounted there is writable by `conveyor models fetch` (`conveyor certs`): Docker
# copies the directory's owner into an empty volume.
RUN groupadd --system --gid 10001 conveyor \
    && useradd --system --uid 10001 --gid conveyor --create-home --home-dir /home/conveyor conveyor \
    && mkdir -p /models /certs \
    && chown conveyor:conveyor /models /certs
USER 10001:10001
WORKDIR /home/conveyor
VOLUME ["/models"]
# 50051 router (public gRPC), 50060 scheduler, 50061 worker, 29500 torch.distributed rendezvous.
EXPOSE 50051 50060 50061 29500
ENTRYPOINT ["conveyor"]
CMD ["--help"]
