# The operator image: `disagg operator` (kopf, aiohttp, prometheus_client, PyYAML; no torch).
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/disagg/operator:0.1.0 .
#
# Runs as uid/gid 65532 with a read-only root filesystem (the Helm chart's Deployment sets
# both, and mounts /tmp). The chart passes the flags; see `disagg operator --help`.
FROM python:3.11-slim

RUN groupadd --gid 65532 disagg \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin disagg

COPY pyproject.toml README.md /src/
COPY core /src/core
COPY runtime /src/runtime
COPY operator /src/operator
RUN pip install --no-cache-dir --disable-pip-version-check "/src[operator]" \
 && rm -rf /src

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
# 8080: kopf's liveness endpoint (/healthz); 9090: Prometheus /metrics.
EXPOSE 8080 9090
ENTRYPOINT ["disagg", "operator"]
