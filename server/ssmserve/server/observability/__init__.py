"""Observability: the worker's metrics (Prometheus), their HTTP endpoint, and JSON logs.

``metrics``            every number a worker exports, named as Prometheus users expect
``loop_metrics``       counters and histograms written without locks, read at scrape time
``http``               ``/metrics`` over HTTP, on a thread of its own
``logs``               plain text for people, or one JSON object per line
``tracing``            OpenTelemetry spans (optional; a no-op unless configured)
``recent_latency``     percentiles of the most recent step latencies (``ssmserve top``)
``garbage_collector``  the cyclic collector tuned for serving, its pauses measured

Shared by every layer, like ``errors``; imports no layer.
"""
