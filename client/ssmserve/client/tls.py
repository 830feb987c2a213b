"""TLS for the client's channels: which roots to trust, and a certificate for mTLS.

    client = Client("worker.example:50051", tls=TlsConfig(ca=Path("ca.pem")))

``TlsConfig.from_env()`` reads ``SSMSERVE_TLS_CA``, ``SSMSERVE_TLS_CERT`` and
``SSMSERVE_TLS_KEY`` (the CLI's ``--tls-ca``, ``--tls-cert``, ``--tls-key`` win over
them). Files are read when a channel is opened, so a renewed client certificate is used
by the next connection. Worker-to-worker channels use the same class.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsConfigError(ValueError):
    """A TLS file that cannot be used (missing, unreadable, or a half of a pair)."""


@dataclass(frozen=True)
class TlsConfig:
    ca: Path | None = None  # PEM roots to trust; None: the system's roots
    cert: Path | None = None  # PEM client certificate chain, for workers that require one
    key: Path | None = None  # PEM private key of ``cert``

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TlsConfigError("a client certificate needs both --tls-cert and --tls-key")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TlsConfig | None:
        """The config the environment gives, or None when it names no TLS file."""
        env = os.environ if env is None else env
        ca, cert, key = (env.get(f"SSMSERVE_TLS_{n}") or None for n in ("CA", "CERT", "KEY"))
        if not (ca or cert or key):
            return None
        return cls(*(Path(p) if p else None for p in (ca, cert, key)))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "CA"),
            private_key=_read(self.key, "key"),
            certificate_chain=_read(self.cert, "certificate"),
        )


def _read(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"TLS {what} {path}: {exc.strerror or exc}") from None
