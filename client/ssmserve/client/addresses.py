"""A worker's address as people write it, made the ``HOST:PORT`` that gRPC dials.

gRPC reads a target without a port as port 443 (HTTPS), which no ssmserve worker
listens on: a bare host here means the worker's default port instead. Imports nothing
heavy, so the CLI can use it before it loads gRPC.
"""

from __future__ import annotations

#: The port ``ssmserve-server`` listens on by default (``--listen 127.0.0.1:50051``).
DEFAULT_PORT = 50051
# Targets in gRPC's own URI forms (``unix:/path``, ``dns:///host:port``, ...) are
# passed on as written.
_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


def worker_address(text: str) -> str:
    """``text`` with the default port added when it names none: ``host`` ->
    ``host:50051``, ``[::1]`` -> ``[::1]:50051``; ``host:port``, an unbracketed IPv6
    address and gRPC URI targets are returned as written (stripped)."""
    address = text.strip()
    if not address or address.startswith(_SCHEMES):
        return address
    if address.startswith("["):  # [v6] or [v6]:port
        return address if "]:" in address else f"{address}:{DEFAULT_PORT}"
    if ":" not in address:
        return f"{address}:{DEFAULT_PORT}"
    return address
