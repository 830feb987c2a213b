"""Observability: the worker's metrics (Prometheus), their HTTP endpoint, and JSON logs.

Shared by every layer, like ``errors``; imports no layer.
"""
