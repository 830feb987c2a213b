"""MetricsEndpoint: ``/metrics`` over HTTP, for Prometheus to scrape.

prometheus-client's own WSGI server, on a thread of its own, so a scrape never waits for
the event loop (and a busy loop never makes a scrape time out). It reads only the
registry, whose scrape-time gauges copy what they need (``metrics.WorkerView``).
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server


class MetricsEndpoint:
    def __init__(self, listen: str, registry: CollectorRegistry) -> None:
        host, _, port = listen.rpartition(":")
        self.host = host.strip("[]") or "127.0.0.1"
        self.port = int(port)
        self.registry = registry
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        """Serve; returns host:port (port 0 picks a free one)."""
        self._server, self._thread = start_http_server(
            self.port, addr=self.host, registry=self.registry
        )
        self.port = self._server.server_address[1]
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
