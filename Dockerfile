FROM python:3.11-slim

WORKDIR /app
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md ./
COPY server ./server
COPY client ./client
COPY protos ./protos
RUN pip install --no-cache-dir .

# numba compiles the engine's kernels on first use and caches them here; the image ships
# them compiled (ready means warm) and the cache stays writable for the non-root user
# (a CPU other than the build machine's recompiles into it once).
ENV NUMBA_CACHE_DIR=/var/cache/ssmserve/numba
RUN useradd --create-home ssmserve \
    && mkdir -p "$NUMBA_CACHE_DIR" \
    && cd / && python -m ssmserve.server.engine.lane \
    && chown -R ssmserve "$NUMBA_CACHE_DIR"
USER ssmserve
WORKDIR /home/ssmserve
EXPOSE 50051
# The main job: a server on an embedded Redis plus the demo client (see README). To serve:
#   docker run -p 50051:50051 ssmserve ssmserve-server --demo --listen 0.0.0.0:50051
CMD ["python", "-m", "ssmserve.client.demo"]
