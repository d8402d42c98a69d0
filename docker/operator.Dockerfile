# The operator image: `disagg operator` (kopf, aiohttp, prometheus_client, PyYAML; no torch).
#
#   make images          (both images, tagged ghcr.io/disagg/{operator,runtime}:<version>)
#   docker build -f docker/operator.Dockerfile -t ghcr.io/disagg/operator:0.1.0 .
#
# BASE_IMAGE: any Debian-like image with Python 3.11+ whose `pip` is on PATH (default
# python:3.11-slim; docker/local-base.sh makes one where no registry is reachable).
# Runs as uid/gid 65532 with a read-only root filesystem (the Helm chart's Deployment sets
# both, and mounts /tmp). The chart passes the flags; see `disagg operator --help`.
# Layers: the dependencies (from pyproject.toml alone) before the source, so a code change
# rebuilds in seconds. pip's own configuration (indexes, CA bundle) is mounted in by the
# build (docker/build.sh), never copied into the image.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
# pip's configuration for the build steps only (docker/build.sh mounts it; unset: defaults)
ARG PIP_CONFIG_FILE

RUN groupadd --gid 65532 disagg \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin disagg

COPY pyproject.toml /src/
RUN python -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['operator']))" >/src/deps.txt \
 && pip install --no-cache-dir --disable-pip-version-check -r /src/deps.txt

COPY README.md /src/
COPY core /src/core
COPY runtime /src/runtime
COPY operator /src/operator
RUN pip install --no-cache-dir --disable-pip-version-check --no-deps /src \
 && rm -rf /src

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
# 8080: kopf's liveness endpoint (/healthz); 9090: Prometheus /metrics.
EXPOSE 8080 9090
ENTRYPOINT ["disagg", "operator"]
