# The runtime base image for roles: torch (CPU build), the disagg runtime, and `disagg role`
# as entrypoint. A role reads its configuration from the DISAGG_* environment and the
# topology file the operator mounts (docs/contract.md); the operator also sets the command.
# Handlers (your model code) go in an image built FROM this one; the demo handlers
# (disagg_runtime.demo) are included.
#
#   docker build -f docker/runtime.Dockerfile -t ghcr.io/disagg/runtime:0.1.0 .
#
# GPUs: the CPU wheel has no CUDA. For GPU nodes build with a CUDA wheel index, e.g.
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# (the wheel brings its CUDA libraries; the node needs the NVIDIA driver and a device plugin
# or DRA driver). No other base image is needed.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

RUN groupadd --gid 65532 disagg \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin disagg

# torch first, from the PyTorch index, pinned: the runtime extra's "torch>=2.4" is then
# already satisfied and PyPI's multi-GB CUDA build is never pulled.
RUN pip install --no-cache-dir --disable-pip-version-check \
      --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md /src/
COPY core /src/core
COPY runtime /src/runtime
COPY operator /src/operator
RUN pip install --no-cache-dir --disable-pip-version-check "/src[runtime]" \
 && rm -rf /src

# The root filesystem is read-only in pods; /tmp is an emptyDir there.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/tmp/.cache
USER 65532:65532
# 7400: relay ingress; 9400: /metrics /healthz /readyz (the defaults of docs/contract.md).
EXPOSE 7400 9400
ENTRYPOINT ["disagg", "role"]
