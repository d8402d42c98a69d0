# The runtime base image for roles: torch, the disagg runtime, and `disagg role` as
# entrypoint. A role reads its configuration from the DISAGG_* environment and the topology
# file the operator mounts (docs/contract.md); the operator also sets the command.
# Handlers (your model code) go in an image built FROM this one; the demo handlers
# (disagg_runtime.demo) are included.
#
#   make images          (both images, tagged ghcr.io/disagg/{operator,runtime}:<version>)
#   docker build -f docker/runtime.Dockerfile -t ghcr.io/disagg/runtime:0.1.0 .
#
# BASE_IMAGE: any Debian-like image with Python 3.11+ whose `pip` is on PATH (default
# python:3.11-slim; docker/local-base.sh makes one where no registry is reachable).
# TORCH_VARIANT: the torch build, pinned exactly as torch==<TORCH_VERSION>+<TORCH_VARIANT>
# from PyTorch's index for that variant. `cpu` (default; ~1.2 GB image). GPU nodes:
#   --build-arg TORCH_VARIANT=cu128
# (the wheel brings its CUDA libraries, several GB; the node needs the NVIDIA driver and a
# device plugin or DRA driver; no other base image is needed). Only the CPU build is built
# and tested here. TORCH_INDEX_URL empty: pip's configured indexes (a local wheel).
# Layers: torch, then the other dependencies (from pyproject.toml alone), then the source:
# a code change rebuilds in seconds.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
# pip's configuration for the build steps only (docker/build.sh mounts it; unset: defaults)
ARG PIP_CONFIG_FILE

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}

RUN groupadd --gid 65532 disagg \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin disagg

# torch first, pinned with its variant: the runtime extra's "torch>=2.4" is then already
# satisfied and PyPI's multi-GB CUDA build is never pulled.
RUN pip install --no-cache-dir --disable-pip-version-check \
      ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"} \
      "torch==${TORCH_VERSION}+${TORCH_VARIANT}"

COPY pyproject.toml /src/
RUN python -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['runtime']))" >/src/deps.txt \
 && pip install --no-cache-dir --disable-pip-version-check -r /src/deps.txt

COPY README.md /src/
COPY core /src/core
COPY runtime /src/runtime
COPY operator /src/operator
RUN pip install --no-cache-dir --disable-pip-version-check --no-deps /src \
 && rm -rf /src

# The root filesystem is read-only in pods; /tmp is an emptyDir there.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/tmp/.cache
USER 65532:65532
# 7400: relay ingress; 9400: /metrics /healthz /readyz (the defaults of docs/contract.md).
EXPOSE 7400 9400
ENTRYPOINT ["disagg", "role"]
