# The picker image: `picker serve` on a slim Python base, as a non-root user, runtime deps only.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY picker ./picker
COPY config ./config
# xds-protos overwrites opentelemetry-proto's files with an older copy; the OTLP exporter needs the newer.
RUN pip install . \
 && pip install --no-deps --force-reinstall \
      "opentelemetry-proto==$(python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')" \
 && useradd --system --uid 10001 --no-create-home picker

USER 10001
# 9002 ext_proc (gRPC), 9003 gRPC health, 9090 Prometheus /metrics and the admin API
EXPOSE 9002 9003 9090
ENTRYPOINT ["picker", "serve"]
