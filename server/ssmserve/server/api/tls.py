"""TLS on the worker's listener, and mTLS when a client CA is given; certificates reload.

``ssmserve-server --tls-cert FILE --tls-key FILE [--tls-client-ca FILE]``: the listener
speaks TLS only; with a client CA it also requires every client (and every other worker)
to present a certificate that CA signed. gRPC asks :meth:`ReloadingCertificates.fetch`
before each new handshake; when any of the files changed since they were last read, the
new ones are loaded and used for the connections from then on (connections already open
keep theirs). A file that cannot be read or paired keeps the previous certificates in
use and is logged, so a half-written renewal never takes the listener down.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from ssmserve.client.tls import TlsConfig
from ssmserve.server.errors import SsmserveError

log = logging.getLogger(__name__)


class TlsFilesError(SsmserveError):
    """A certificate, key or CA file the listener was given cannot be read."""


@dataclass(frozen=True)
class TlsSettings:
    cert: Path  # PEM certificate chain of this worker
    key: Path  # PEM private key of ``cert``
    client_ca: Path | None = None  # PEM CA that must have signed every client's certificate

    def peer_config(self) -> TlsConfig:
        """How this worker reaches other workers: it trusts the client CA (workers share
        one in a cluster) and presents its own certificate, which mTLS peers require."""
        return TlsConfig(ca=self.client_ca, cert=self.cert, key=self.key)


class ReloadingCertificates:
    """Server credentials whose files are read again when they change."""

    def __init__(self, settings: TlsSettings) -> None:
        self.settings = settings
        self._stamp = self._stamps()
        self.loads = 0  # how many times the files were (re)loaded
        self._initial = self._load()

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial,
            self.fetch,
            require_client_authentication=self.settings.client_ca is not None,
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """The new configuration if a file changed since it was last read, else None."""
        try:
            stamp = self._stamps()
            if stamp == self._stamp:
                return None
            config = self._load()
        except TlsFilesError as exc:
            log.warning("TLS files changed but cannot be used (keeping the old ones): %s", exc)
            return None
        self._stamp = stamp
        log.info("TLS certificates reloaded from %s", self.settings.cert)
        return config

    def _stamps(self) -> tuple[tuple[int, int], ...]:
        return tuple(_stamp(p) for p in self._paths())

    def _paths(self) -> list[Path]:
        s = self.settings
        return [s.cert, s.key] + ([s.client_ca] if s.client_ca else [])

    def _load(self) -> grpc.ServerCertificateConfiguration:
        s = self.settings
        cert, key = _read(s.cert), _read(s.key)
        try:  # the pair must match: gRPC would otherwise fail every handshake later
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(s.cert, s.key)
        except (ssl.SSLError, OSError) as exc:
            raise TlsFilesError(
                f"{s.cert} / {s.key}: not a PEM certificate and its private key ({exc})"
            ) from None
        client_ca = _read(s.client_ca) if s.client_ca else None
        self.loads += 1
        return grpc.ssl_server_certificate_configuration([(key, cert)], client_ca)


def _stamp(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError as exc:
        raise TlsFilesError(f"{path}: {exc.strerror or exc}") from None
    return st.st_mtime_ns, st.st_size


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TlsFilesError(f"{path}: {exc.strerror or exc}") from None
