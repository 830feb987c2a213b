"""Tracing: OpenTelemetry spans for RPCs, engine batches and Redis writes (optional).

Off unless configured (``--trace-otlp-endpoint URL``, or a ``Tracing`` given an exporter
in tests): then nothing of OpenTelemetry is even imported, and every ``span()`` is a
shared no-op context. With it on (``pip install 'ssmserve[tracing]'``), each worker has its
own ``TracerProvider`` (resource ``service.name=ssmserve``, ``ssmserve.worker_id``)
exporting in batches over OTLP/gRPC, and records:

- one SERVER span per RPC (``rpc_metrics``), named ``ssmserve.v1.SessionService/Stream``
  and so on, with ``rpc.system``, ``rpc.service``, ``rpc.method`` and
  ``rpc.grpc.status_code``; a caller's W3C ``traceparent`` metadata makes it a child;
- ``engine.batch`` per stepper engine call (model, batch size);
- ``redis.<operation>`` per Store write (script or pipeline);
- worker-to-worker calls carry the current context (``inject``), so a migration's
  AdoptSession on the target is part of the Migrate trace on the source.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

_NOOP = contextlib.nullcontext()


class Tracing:
    """One worker's tracer: ``span()`` is a no-op unless an exporter was configured."""

    def __init__(
        self, endpoint: str = "", worker_id: str = "", exporter: Any | None = None
    ) -> None:
        self.enabled = bool(endpoint or exporter)
        self._tracer: Any = None
        self._provider: Any = None
        if not self.enabled:
            return
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError:
            raise TracingUnavailableError(
                "tracing needs OpenTelemetry: pip install 'ssmserve[tracing]'"
            ) from None
        resource = Resource.create({"service.name": "ssmserve", "ssmserve.worker_id": worker_id})
        self._provider = TracerProvider(resource=resource)
        if exporter is not None:  # tests: spans at once, in memory
            self._provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint)))
        self._tracer = self._provider.get_tracer("ssmserve")

    def span(
        self, name: str, attributes: Mapping[str, Any] | None = None, server: bool = False
    ) -> contextlib.AbstractContextManager[Any]:
        """A span around a block (no-op when off); ``server``: an RPC being served."""
        if self._tracer is None:
            return _NOOP
        from opentelemetry.trace import SpanKind

        kind = SpanKind.SERVER if server else SpanKind.INTERNAL
        return self._tracer.start_as_current_span(name, kind=kind, attributes=attributes)

    @contextlib.contextmanager
    def server_span(
        self, name: str, metadata: Sequence[tuple[str, Any]] | None, attributes: Mapping[str, Any]
    ) -> Iterator[Any]:
        """An RPC's span, a child of the caller's ``traceparent`` when it sent one."""
        if self._tracer is None:
            yield None
            return
        from opentelemetry import context, propagate

        carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
        token = context.attach(propagate.extract(carrier))
        try:
            with self.span(name, attributes, server=True) as span:
                yield span
        finally:
            context.detach(token)

    def outgoing(self) -> tuple[tuple[str, str], ...]:
        """Metadata carrying the current context to another worker (empty when off)."""
        if self._tracer is None:
            return ()
        from opentelemetry import propagate

        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        return tuple(carrier.items())

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


class TracingUnavailableError(RuntimeError):
    """Tracing was asked for and OpenTelemetry is not installed."""


#: The tracer of components nobody configured (tests that build them directly).
OFF = Tracing()
