"""TLS and mTLS on the worker's listener, with certificates the test makes; reload.

Every certificate is made here (``cryptography``): a CA, a worker certificate for
127.0.0.1 / localhost, a client certificate. Loopback only.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ssmserve.client.cli import main as cli_main
from ssmserve.client.errors import SsmserveClientError
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.sync import Client
from ssmserve.client.tls import TlsConfig, TlsConfigError
from ssmserve.server.api.tls import ReloadingCertificates, TlsFilesError, TlsSettings
from ssmserve.server.embedded_redis import free_port
from tests.conftest import random_inputs
from tests.harness import WorkerHarness
from tests.test_service import assert_bit_equal, reference

# Fail fast: a refused handshake is UNAVAILABLE, which a patient client would retry.
QUICK = RetryPolicy(give_up_after_s=2.0, call_timeout_s=5.0)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class Authority:
    """A test CA that writes PEM files into ``directory``."""

    def __init__(self, directory: Path, name: str) -> None:
        self.dir, self.name = directory, name
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.ca = directory / f"{name}-ca.pem"
        self.ca.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, cn: str, server: bool) -> tuple[Path, Path]:
        """A certificate for 127.0.0.1 / localhost (usable as server and client)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] * server)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        cert_path, key_path = self.dir / f"{cn}.pem", self.dir / f"{cn}-key.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(_pem_key(key))
        return cert_path, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    directory = tmp_path_factory.mktemp("pki")
    ca = Authority(directory, "ssmserve-test")
    other = Authority(directory, "another")
    return {
        "ca": ca,
        "other": other,
        "worker": ca.issue("worker", server=True),
        "client": ca.issue("client", server=False),
        "stranger": other.issue("stranger", server=False),
    }


def _stream_and_check(client: Client, served_models) -> None:
    model = served_models["demo"]
    x = random_inputs(model, 12, seed=31)
    sid = client.create_session("demo").session_id
    got = np.stack([o.output for o in client.stream_steps(sid, list(x))])
    assert_bit_equal(got, reference(model, x))
    client.rollback(sid, to_step=4)
    again = np.stack([o.output for o in client.stream_steps(sid, list(x[4:]))])
    assert_bit_equal(again, reference(model, x)[4:])


def test_tls_listener_serves_tls_clients_and_refuses_plaintext(start_worker, served_models, pki):
    ca = pki["ca"]
    cert, key = pki["worker"]
    w = start_worker(tls=TlsSettings(cert, key), client_tls=TlsConfig(ca=ca.ca))
    _stream_and_check(w.client, served_models)
    with Client(w.address, retry=QUICK) as plain, pytest.raises(SsmserveClientError) as err:
        plain.list_sessions()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    # A client that trusts another CA refuses the worker's certificate.
    wrong = TlsConfig(ca=pki["other"].ca)
    with Client(w.address, retry=QUICK, tls=wrong) as c, pytest.raises(SsmserveClientError):
        c.list_sessions()


def test_mtls_requires_a_client_certificate_from_the_client_ca(start_worker, served_models, pki):
    ca = pki["ca"]
    cert, key = pki["worker"]
    client_cert, client_key = pki["client"]
    trusted = TlsConfig(ca=ca.ca, cert=client_cert, key=client_key)
    w = start_worker(tls=TlsSettings(cert, key, client_ca=ca.ca), client_tls=trusted)
    _stream_and_check(w.client, served_models)
    stranger_cert, stranger_key = pki["stranger"]
    for tls in (
        TlsConfig(ca=ca.ca),  # no certificate
        TlsConfig(ca=ca.ca, cert=stranger_cert, key=stranger_key),  # signed by another CA
    ):
        with Client(w.address, retry=QUICK, tls=tls) as refused:
            with pytest.raises(SsmserveClientError) as err:
                refused.list_sessions()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_workers_migrate_sessions_over_mtls(start_worker, served_models, pki):
    """Worker-to-worker calls (the hand-off's AdoptSession) use TLS with the worker's own
    certificate, which the other worker's mTLS listener requires."""
    ca = pki["ca"]
    cert, key = pki["worker"]
    client_cert, client_key = pki["client"]
    client_tls = TlsConfig(ca=ca.ca, cert=client_cert, key=client_key)
    a, b = (
        start_worker(tls=TlsSettings(cert, key, client_ca=ca.ca), client_tls=client_tls)
        for _ in range(2)
    )
    model = served_models["demo"]
    x = random_inputs(model, 10, seed=32)
    sid = a.client.create_session("demo").session_id
    first = [o.output for o in a.client.stream_steps(sid, list(x[:5]))]
    moved = a.client.migrate(sid, b.address)
    assert moved.target == b.address
    rest = [o.output for o in a.client.stream_steps(sid, list(x[5:]))]  # follows to B
    assert_bit_equal(np.stack(first + rest), reference(model, x))
    assert sid in b.manager.resident_ids()


def test_certificates_reload_when_their_files_change(start_worker, served_models, pki, tmp_path):
    ca, other = pki["ca"], pki["other"]
    live_cert, live_key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert, key = pki["worker"]
    live_cert.write_bytes(cert.read_bytes())
    live_key.write_bytes(key.read_bytes())
    w = start_worker(tls=TlsSettings(live_cert, live_key), client_tls=TlsConfig(ca=ca.ca))
    w.client.list_sessions()
    # Renew: a certificate from another CA, written over the same files.
    new_cert, new_key = other.issue("renewed", server=True)
    live_key.write_bytes(new_key.read_bytes())
    live_cert.write_bytes(new_cert.read_bytes())
    stamp = time.time() + 5  # a new mtime even on coarse-grained file systems
    for path in (live_cert, live_key):
        os.utime(path, (stamp, stamp))
    # New connections get the new certificate: only clients trusting the new CA connect.
    with Client(w.address, retry=QUICK, tls=TlsConfig(ca=other.ca)) as renewed:
        assert renewed.list_sessions() is not None
    stale = TlsConfig(ca=ca.ca)
    with Client(w.address, retry=QUICK, tls=stale) as c, pytest.raises(SsmserveClientError):
        c.list_sessions()
    assert w.worker.certificates is not None and w.worker.certificates.loads == 2


def test_unusable_certificate_files_are_clear_errors_and_keep_the_old_ones(pki, tmp_path):
    cert, key = pki["worker"]
    other_cert, _ = pki["stranger"]
    with pytest.raises(TlsFilesError, match=r"no-such\.pem"):
        ReloadingCertificates(TlsSettings(tmp_path / "no-such.pem", key))
    with pytest.raises(TlsFilesError, match="private key"):
        ReloadingCertificates(TlsSettings(other_cert, key))  # a key of another certificate
    live_cert, live_key = tmp_path / "cert.pem", tmp_path / "key.pem"
    live_cert.write_bytes(cert.read_bytes())
    live_key.write_bytes(key.read_bytes())
    certificates = ReloadingCertificates(TlsSettings(live_cert, live_key))
    live_cert.write_bytes(b"half a renewal")
    assert certificates.fetch() is None and certificates.loads == 1  # the old pair stays
    with pytest.raises(TlsConfigError, match="both"):
        TlsConfig(cert=cert)


def test_cli_talks_tls_from_flags_and_environment(start_worker, pki, capsys, monkeypatch):
    ca = pki["ca"]
    cert, key = pki["worker"]
    w = start_worker(tls=TlsSettings(cert, key), client_tls=TlsConfig(ca=ca.ca))
    assert cli_main(["--server", w.address, "--tls-ca", str(ca.ca), "workers"]) == 0
    assert w.address in capsys.readouterr().out
    monkeypatch.setenv("SSMSERVE_TLS_CA", str(ca.ca))
    assert cli_main(["--server", w.address, "workers"]) == 0
    capsys.readouterr()
    assert cli_main(["--server", w.address, "--tls-ca", str(pki["worker"][0].parent / "nope.pem"),
                     "workers"]) == 2  # fmt: skip
    assert "nope.pem" in capsys.readouterr().err


def test_server_flags_need_a_whole_pair(pki, tmp_path):
    from ssmserve.server.main import build_parser, settings_from_args

    cert, key = pki["worker"]
    ca = pki["ca"].ca
    base = ["--model", f"demo={tmp_path}"]

    def settings(*flags: str):
        return settings_from_args(build_parser().parse_args([*base, *flags]))

    tls = settings("--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(ca)).tls
    assert tls == TlsSettings(cert, key, ca) and settings().tls is None
    for flags in (("--tls-cert", str(cert)), ("--tls-client-ca", str(ca))):
        with pytest.raises(SystemExit, match="--tls-key"):
            settings(*flags)


def test_a_worker_reaches_redis_over_tls(pki, tmp_path, model_dirs):
    """``rediss://`` with the CA as a URL option: the store talks TLS to Redis."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server on PATH (the TLS test needs one built with TLS)")
    cert, key = pki["worker"]
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
         "--tls-key-file", str(key), "--tls-ca-cert-file", str(pki["ca"].ca),
         "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={pki['ca'].ca}"
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                pytest.skip(f"redis-server has no TLS here: {proc.stderr.read()[-200:]!r}")
            try:
                with redis.Redis.from_url(url) as r:
                    r.ping()
                break
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline, "TLS redis-server did not come up"
                time.sleep(0.05)
        worker = WorkerHarness(model_dirs, url)
        try:
            sid = worker.client.create_session("demo").session_id
            assert worker.client.get_session(sid).step == 0
        finally:
            worker.stop()
        # Without the CA the certificate is refused: the worker would not start.
        with (
            pytest.raises(redis.exceptions.ConnectionError),
            redis.Redis.from_url(f"rediss://127.0.0.1:{port}/0") as r,
        ):
            r.ping()
    finally:
        proc.terminate()
        proc.wait(10)
