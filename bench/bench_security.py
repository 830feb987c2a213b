"""What TLS and bearer tokens cost a served step, side by side with plaintext, in one run.

Usage: ``.venv/bin/python bench/bench_security.py [--quick] [--json OUT]``

Processes: one redis-server (private), three ``ssmserve-server`` workers serving the
demo model on it: plaintext, TLS, and TLS + ``--auth-tokens`` (every call checked by the
interceptor and scoped to the token's tenant). Certificates are made here (cryptography).
This process is the client (grpc.aio). Rounds alternate the three workers, so drift on
this shared machine hits them alike; the ratios are the result.

Measured:
- step latency p50/p99: one session, one step per message, ping-pong on one stream;
- throughput: 64 sessions, one stream each, ping-pong, all at once (steps/s).
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import ipaddress
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from harness import (
    interleaved,
    private_redis,
    ratio,
    standard_parser,
    start_server,
    table,
    write_result,
)

from ssmserve.client.aio import step_input
from ssmserve.server.api.auth import token_entry, token_hash
from ssmserve.server.main import ensure_demo_model
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc

TOKEN = "ssm_bench-token-not-secret"


def make_pki(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a certificate for 127.0.0.1 signed by it: (ca, cert, key) PEM files."""
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder().subject_name(name("bench-ca")).issuer_name(name("bench-ca"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(name("worker")).issuer_name(ca.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


class Target:
    """One worker and how to reach it."""

    def __init__(self, name: str, address: str, ca: Path | None, token: str | None) -> None:
        self.name, self.address = name, address
        self.credentials = grpc.ssl_channel_credentials(ca.read_bytes()) if ca else None
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.latency: list[float] = []
        self.throughput: list[float] = []

    def channel(self) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(self.address)
        return grpc.aio.secure_channel(self.address, self.credentials)


async def ping_pong(target: Target, stub: pb_grpc.SessionServiceStub, steps: int) -> list[float]:
    """Seconds per step on one stream, one step per message."""
    sid = (await stub.CreateSession(pb.CreateSessionRequest(model="demo"),
                                    metadata=target.metadata)).session_id  # fmt: skip
    x = np.random.default_rng(0).standard_normal((steps, 4)).astype(np.float32)
    queue: asyncio.Queue[pb.StreamRequest | None] = asyncio.Queue()

    async def requests():
        while (request := await queue.get()) is not None:
            yield request

    call = stub.Stream(requests(), metadata=target.metadata)
    times = []
    for t in range(steps):
        t0 = time.perf_counter()
        await queue.put(pb.StreamRequest(steps=[step_input(sid, t + 1, x[t])]))
        response = await call.read()
        assert not response.results[0].HasField("error"), response
        times.append(time.perf_counter() - t0)
    await queue.put(None)
    await stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=target.metadata)
    return times


async def measure(target: Target, steps: int, sessions: int) -> float:
    """One round of ``target``: its latency samples kept, its steps/s returned."""
    async with target.channel() as channel:
        stub = pb_grpc.SessionServiceStub(channel)
        times = await ping_pong(target, stub, steps)
        target.latency.extend(times[5:])  # the first steps open the connection
        t0 = time.perf_counter()
        done = await asyncio.gather(*(ping_pong(target, stub, steps) for _ in range(sessions)))
        elapsed = time.perf_counter() - t0
        target.throughput.append(sum(len(d) for d in done) / elapsed)
        return target.throughput[-1]


def run_round(target: Target, steps: int, sessions: int) -> float:
    return asyncio.run(measure(target, steps, sessions))


def side_by_side(targets: list[Target], baseline: str, sessions: int) -> dict[str, dict]:
    """Print latency and throughput of ``targets`` with ratios to the first; the figures,
    with each target's steps/s over the first's round by round (median and range)."""
    base = targets[0].name
    p50 = {t.name: float(np.percentile(t.latency, 50)) * 1000 for t in targets}
    p99 = {t.name: float(np.percentile(t.latency, 99)) * 1000 for t in targets}
    rate = {t.name: float(np.median(t.throughput)) for t in targets}
    rows = [
        [t.name, p50[t.name], p99[t.name], p50[t.name] / p50[base], rate[t.name],
         rate[t.name] / rate[base]]
        for t in targets
    ]  # fmt: skip
    print(table(["worker", "step p50 ms", "step p99 ms", f"p50 vs {baseline}",
                 f"steps/s ({sessions} sessions)", f"throughput vs {baseline}"], rows))  # fmt: skip
    per_round = {t.name: ratio(t.throughput, targets[0].throughput).as_dict() for t in targets}
    return {"p50_ms": p50, "p99_ms": p99, "steps_per_s": rate, "steps_per_s_ratio": per_round}


def main() -> int:
    parser = standard_parser(__doc__, quick="fewer samples (smoke run)")
    args = parser.parse_args()
    rounds, steps, sessions = (2, 40, 64) if args.quick else (5, 200, 64)
    with (
        tempfile.TemporaryDirectory() as tmp_dir,
        private_redis(Path(tmp_dir) / "redis") as redis_server,
    ):
        tmp = Path(tmp_dir)
        model = ensure_demo_model(tmp / "demo")
        ca, cert, key = make_pki(tmp)
        tokens = tmp / "tokens.toml"
        tokens.write_text(token_entry(token_hash(TOKEN), "bench", "client"))
        base = [sys.executable, "-m", "ssmserve.server.main", "--model", f"demo={model}",
                "--listen", "127.0.0.1:0", "--redis-url", redis_server.url]  # fmt: skip
        tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
        procs = []
        try:
            targets = []
            for name, extra, use_ca, token in (
                ("plaintext", [], False, None),
                ("TLS", tls, True, None),
                ("TLS + token", [*tls, "--auth-tokens", str(tokens)], True, TOKEN),
            ):
                proc, address = start_server(base + extra)
                procs.append(proc)
                targets.append(Target(name, address, ca if use_ca else None, token))
            cases = {t.name: functools.partial(run_round, t, steps, sessions) for t in targets}
            interleaved(cases, rounds)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(20)
    print(f"# TLS and tokens vs plaintext ({rounds} rounds, alternating; demo model, log)")
    print()
    figures = side_by_side(targets, "plain", sessions)
    if args.json:
        write_result(args.json, figures, line=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
