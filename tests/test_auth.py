"""Bearer tokens, roles and tenants: who may call what, and on whose sessions.

An authorization matrix over every SessionService RPC x {no token, tenant A's client,
tenant B's client, operator, admin} x {A's session, B's session}: the exact status code,
and nothing changed where the call was refused. Plus the token file: made by the CLI,
hashes only, reloaded when it changes; and the loopback-only rule without tokens.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from ssmserve.client.aio import step_input
from ssmserve.client.cli import main as cli_main
from ssmserve.client.sync import Client
from ssmserve.server.api.auth import TokenFileError, parse_token_file, token_hash
from ssmserve.server.worker import ExposedWithoutAuthError, WorkerSettings, check_exposure
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc
from tests.conftest import make_token, random_inputs

OK = grpc.StatusCode.OK
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED
NOT_FOUND = grpc.StatusCode.NOT_FOUND


def test_token_file_holds_hashes_only_and_refuses_bad_entries(tokens, capsys) -> None:
    text = tokens["path"].read_text()
    assert oct(tokens["path"].stat().st_mode & 0o777) == "0o600"
    for who in ("a", "b", "operator", "admin"):
        assert tokens[who].startswith("ssm_") and tokens[who] not in text
        assert token_hash(tokens[who]) in text
    principals = parse_token_file(text)
    assert {(p.tenant, p.role.value) for p in principals.values()} == {
        ("tenant-a", "client"), ("tenant-b", "client"), ("ops", "operator"), ("ops", "admin"),
    }  # fmt: skip
    for bad in (
        '[[token]]\nsha256 = "xyz"\ntenant = "t"\nrole = "client"\n',
        f'[[token]]\nsha256 = "{"0" * 64}"\ntenant = "a~b"\nrole = "client"\n',
        f'[[token]]\nsha256 = "{"0" * 64}"\ntenant = "t"\nrole = "worker"\n',
        "not toml [",
    ):
        with pytest.raises(TokenFileError):
            parse_token_file(bad)
    # The CLI never appends to a file the server would refuse.
    broken = tokens["path"].parent / "broken.toml"
    broken.write_text("not toml [")
    code = cli_main(["auth", "token", "--tenant", "t", "--role", "client", "--file", str(broken)])
    assert code == 2 and "not TOML" in capsys.readouterr().err
    assert broken.read_text() == "not toml ["


class Caller:
    """Raw calls with a given token (no redirects, no retries), on one client's loop."""

    def __init__(self, client: Client, address: str, token: str | None) -> None:
        self.client, self.address = client, address
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def code(self, rpc: str, request: Any) -> grpc.StatusCode:
        return self.client._run(self._code(rpc, request))

    async def _code(self, rpc: str, request: Any) -> grpc.StatusCode:
        stub = pb_grpc.SessionServiceStub(self.client._aio.router.worker(self.address).channel)
        method = getattr(stub, rpc)
        try:
            if rpc == "Stream":
                responses = [r async for r in method(iter([request]), metadata=self.metadata)]
                errors = [r.error.code for x in responses for r in x.results if r.HasField("error")]
                return grpc.StatusCode.OK if not errors else _code_of(errors[0])
            if rpc == "ImportCheckpoint":
                await method(iter(request), metadata=self.metadata, timeout=10)
            elif rpc in ("ExportCheckpoint", "Forecast", "GetHistory", "Generate"):
                async for _ in method(request, metadata=self.metadata, timeout=10):
                    pass
            else:
                await method(request, metadata=self.metadata, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def _code_of(number: int) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == number)


def _requests(sid: str, step: int, x: np.ndarray, blob: bytes) -> dict[str, Any]:
    """One request per session RPC against session ``sid`` (client-side id)."""
    chunk = pb.CheckpointChunk(index=0, data=blob, total_size=len(blob), last=True)
    return {
        "GetSession": pb.GetSessionRequest(session_id=sid),
        "ListSnapshots": pb.ListSnapshotsRequest(session_id=sid),
        "Snapshot": pb.SnapshotRequest(session_id=sid),
        "Stream": pb.StreamRequest(steps=[step_input(sid, step + 1, x)]),
        "Rollback": pb.RollbackRequest(session_id=sid, step=step),
        "Forecast": pb.ForecastRequest(session_id=sid, horizon=2),
        # The matrix's model is a signal model: Generate passes the checks of who may call
        # it and is then refused for the model (FAILED_PRECONDITION, ``ALLOWED_BUT``).
        "Generate": pb.GenerateRequest(session_id=sid, max_tokens=1),
        "Fork": pb.ForkRequest(session_id=sid),
        "ExportCheckpoint": pb.ExportCheckpointRequest(session_id=sid),
        "GetHistory": pb.GetHistoryRequest(session_id=sid),
        "Upgrade": pb.UpgradeRequest(session_id=sid),  # to the version it runs: a no-op
        "ImportCheckpoint": [
            pb.ImportCheckpointRequest(header=pb.ImportHeader(session_id=sid, replace=True)),
            pb.ImportCheckpointRequest(chunk=chunk),
        ],
        "CloseSession": pb.CloseSessionRequest(session_id=sid),
    }


#: What an allowed call of the matrix answers where that is not OK (the call was let
#: through, then refused for what it asked).
ALLOWED_BUT = {"Generate": grpc.StatusCode.FAILED_PRECONDITION}


def test_the_matrix_covers_every_session_rpc() -> None:
    methods = set(pb.DESCRIPTOR.services_by_name["SessionService"].methods_by_name)
    made = set(_requests("s", 0, np.zeros(4, np.float32), b"").keys())
    assert methods - made == {"CreateSession", "ListSessions", "ListModels"}  # no session


def test_authorization_matrix(start_worker, served_models, tokens) -> None:
    w = start_worker(auth_tokens=tokens["path"], client_tls=None)
    model = served_models["demo"]
    x = random_inputs(model, 4, seed=51)
    with (
        Client(w.address, token=tokens["a"]) as a,
        Client(w.address, token=tokens["b"]) as b,
        Client(w.address, token=tokens["admin"]) as admin,
    ):
        # The same id in two tenants: two sessions that never meet.
        a.create_session("demo", session_id="shared")
        b.create_session("demo", session_id="shared")
        list(a.stream_steps("shared", list(x[:2])))
        list(b.stream_steps("shared", list(x[:3])))
        assert a.get_session("shared").step == 2 and b.get_session("shared").step == 3
        assert [s.session_id for s in a.list_sessions()] == ["shared"]
        info = a.get_session("shared")
        assert info.tenant == "tenant-a"
        stored = sorted(s.session_id for s in admin.list_sessions())
        assert stored == ["tenant-a~shared", "tenant-b~shared"]
        blob = b.export_checkpoint("shared")

        def snapshot_of(stored_id: str) -> tuple[int, int]:
            info = admin.get_session(stored_id)
            return info.step, info.snapshot_count

        def caller(who: str | None) -> Caller:
            return Caller(w.client, w.address, tokens[who] if who else None)

        before_b = snapshot_of("tenant-b~shared")
        # No token: nothing at all, not even a listing.
        for rpc, request in _requests("shared", 3, x[3], blob).items():
            assert caller(None).code(rpc, request) == UNAUTHENTICATED, rpc
        assert caller(None).code("ListSessions", pb.ListSessionsRequest()) == UNAUTHENTICATED
        assert caller(None).code("ListModels", pb.ListModelsRequest()) == UNAUTHENTICATED
        bogus = Caller(w.client, w.address, "ssm_not-a-token")
        assert bogus.code("GetSession", pb.GetSessionRequest(session_id="x")) == UNAUTHENTICATED
        # Tenant A names "shared" and gets its own; B's is untouched by any of it.
        for rpc, request in _requests("tenant-b~shared", 3, x[3], blob).items():
            got = caller("a").code(rpc, request)
            # A client's ids are plain ids: another tenant's stored id is not even valid.
            assert got in (NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), (rpc, got)
        assert snapshot_of("tenant-b~shared") == before_b
        # Operators read every tenant's sessions and may change none.
        operator = caller("operator")
        for rpc, request in _requests("tenant-b~shared", 3, x[3], blob).items():
            want = OK if rpc in ("GetSession", "ListSnapshots", "GetHistory") else DENIED
            assert operator.code(rpc, request) == want, rpc
        assert operator.code("ListSessions", pb.ListSessionsRequest()) == OK
        assert operator.code("ListModels", pb.ListModelsRequest()) == OK
        assert snapshot_of("tenant-b~shared") == before_b
        # The admin may do everything, on any tenant (by stored id).
        for rpc, request in _requests("tenant-b~shared", 3, x[3], blob).items():
            if rpc == "ImportCheckpoint":
                continue  # replaces the session: checked below on a copy of its own
            assert caller("admin").code(rpc, request) == ALLOWED_BUT.get(rpc, OK), rpc
        # A client does everything on its own sessions (the last closes it).
        for rpc, request in _requests("shared", 2, x[2], blob).items():
            assert caller("a").code(rpc, request) == ALLOWED_BUT.get(rpc, OK), rpc


def test_cluster_rpcs_by_role(start_worker, tokens) -> None:
    w = start_worker(auth_tokens=tokens["path"])

    def code(who: str, rpc: str, request: Any) -> grpc.StatusCode:
        async def call() -> grpc.StatusCode:
            channel = w.client._aio.router.worker(w.address).channel
            method = getattr(pb_grpc.ClusterServiceStub(channel), rpc)
            metadata = (("authorization", f"Bearer {tokens[who]}"),)
            try:
                await method(request, metadata=metadata, timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return OK

        return w.client._run(call())

    workers = pb.ListWorkersRequest()
    assert code("a", "ListWorkers", workers) == DENIED
    assert code("operator", "ListWorkers", workers) == OK
    adopt = pb.AdoptSessionRequest(session_id="nope")
    assert code("operator", "AdoptSession", adopt) == DENIED  # workers (and admins) only
    assert code("admin", "AdoptSession", adopt) == NOT_FOUND


def test_health_stays_open_and_tokens_reload(start_worker, tokens, capsys) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    w = start_worker(auth_tokens=tokens["path"])

    async def health() -> int:
        channel = w.client._aio.router.worker(w.address).channel
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        return reply.status

    assert w.client._run(health()) == health_pb2.HealthCheckResponse.SERVING
    # A token made after the worker started works once the file is read again.
    late = make_token(capsys, tokens["path"], "tenant-c", "client")
    stamp = tokens["path"].stat().st_mtime + 5
    os.utime(tokens["path"], (stamp, stamp))
    w.call(asyncio.sleep(0))
    assert w.worker.tokens is not None
    w.worker.tokens.reload()
    with Client(w.address, token=late) as c:
        assert c.list_sessions() == []
    # A broken file keeps the tokens as they were.
    tokens["path"].write_text("broken [")
    assert not w.worker.tokens.reload(force=True)
    with Client(w.address, token=late) as c:
        assert c.list_sessions() == []


def test_without_tokens_only_loopback_is_served(model_dirs, tmp_path: Path) -> None:
    models = tuple(model_dirs.items())
    for listen in ("0.0.0.0:50051", "10.1.2.3:50051", "[::]:50051", "worker.example:1"):
        with pytest.raises(ExposedWithoutAuthError, match="--auth-tokens"):
            check_exposure(WorkerSettings(models=models, listen=listen))
        check_exposure(WorkerSettings(models=models, listen=listen, insecure=True))
        check_exposure(WorkerSettings(models=models, listen=listen, auth_tokens=tmp_path))
    for listen in ("127.0.0.1:0", "[::1]:50051", "localhost:50051", "127.3.4.5:1"):
        check_exposure(WorkerSettings(models=models, listen=listen))


def test_cli_sends_the_token(start_worker, tokens, capsys, monkeypatch) -> None:
    w = start_worker(auth_tokens=tokens["path"])
    assert cli_main(["--server", w.address, "session", "list"]) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert cli_main(["--server", w.address, "--token", tokens["a"], "session", "list"]) == 0
    # as a Kubernetes Secret made from a file holds it: a trailing newline is no part of it
    monkeypatch.setenv("SSMSERVE_TOKEN", tokens["operator"] + "\n")
    assert cli_main(["--server", w.address, "workers"]) == 0
    capsys.readouterr()


def test_exports_are_signed_and_only_signed_imports_come_back(start_worker, model_dirs) -> None:
    from dataclasses import replace

    from ssmserve.client.errors import InvalidArgument
    from ssmserve.server.api.service import ServiceSettings
    from ssmserve.server.state.checkpoint_signing import TRAILER_BYTES

    key = b"a-shared-checkpoint-key-0123456789"
    strict = replace(ServiceSettings(), checkpoint_key=key, require_signed_checkpoints=True)
    w = start_worker(service=strict)
    plain = start_worker()  # no key: exports unsigned, imports anything (stripping trailers)
    sid = w.client.create_session("demo").session_id
    signed = w.client.export_checkpoint(sid)
    unsigned = plain.client.export_checkpoint(plain.client.create_session("demo").session_id)
    assert w.client.import_checkpoint(signed, "back").session_id == "back"
    tampered = bytearray(signed)
    tampered[-TRAILER_BYTES - 5] ^= 1
    for blob in (unsigned, bytes(tampered), signed[:-TRAILER_BYTES]):
        with pytest.raises(InvalidArgument, match="sign"):
            w.client.import_checkpoint(blob, "refused")
    assert "refused" not in {s.session_id for s in w.client.list_sessions()}
    assert plain.client.import_checkpoint(signed, "stripped").step == 0


def test_tenant_budgets_refuse_past_the_limit_and_spare_other_tenants(start_worker, tokens):
    from dataclasses import replace

    from ssmserve.client.errors import ResourceExhausted
    from ssmserve.server.api.budgets import BudgetSettings
    from ssmserve.server.api.service import ServiceSettings

    budgets = BudgetSettings(sessions_per_tenant=2, import_buffer_bytes=4096)
    w = start_worker(
        auth_tokens=tokens["path"], service=replace(ServiceSettings(), budgets=budgets)
    )
    with Client(w.address, token=tokens["a"]) as a, Client(w.address, token=tokens["b"]) as b:
        first = a.create_session("demo").session_id
        a.create_session("demo")
        for make in (lambda: a.create_session("demo"), lambda: a.fork(first)):
            with pytest.raises(ResourceExhausted, match="has 2 sessions, its budget is 2"):
                make()
        assert len(a.list_sessions()) == 2
        b.create_session("demo")  # another tenant does not notice
        blob = b.export_checkpoint(b.list_sessions()[0].session_id)
        assert len(blob) > 4096
        with pytest.raises(ResourceExhausted, match="import budget of 4,096 bytes"):
            b.import_checkpoint(blob, "too-big")
        a.close_session(first)
        a.create_session("demo")  # room again


def test_running_imports_and_forecasts_are_counted_per_tenant() -> None:
    from ssmserve.server.api.budgets import BudgetExceededError, Budgets, BudgetSettings

    budgets = Budgets(BudgetSettings(imports_per_tenant=1, forecasts_per_tenant=1), store=None)
    with budgets.importing("a") as buffer:
        buffer.reserve(100)
        assert budgets.import_bytes == 100
        with (
            pytest.raises(BudgetExceededError, match="already runs 1 imports"),
            budgets.importing("a"),
        ):
            pass
        with budgets.importing("b"):
            pass  # another tenant
        with budgets.importing(None), budgets.importing(None):
            pass  # no tenant (no --auth-tokens): no per-tenant budget
    assert budgets.import_bytes == 0
    with budgets.forecasting_or_none("a") as slot:
        slot.take()
        with budgets.forecasting_or_none("a") as second, pytest.raises(BudgetExceededError):
            second.take()
    with budgets.forecasting_or_none("a") as slot:
        slot.take()  # released when the first forecast ended


def test_a_tenant_resident_bytes_budget(start_worker, tokens):
    from dataclasses import replace

    from ssmserve.client.errors import ResourceExhausted
    from ssmserve.server.api.budgets import BudgetSettings
    from ssmserve.server.api.service import ServiceSettings

    service = replace(ServiceSettings(), budgets=BudgetSettings(resident_bytes_per_tenant=1))
    w = start_worker(auth_tokens=tokens["path"], service=service)
    with Client(w.address, token=tokens["a"]) as a, Client(w.address, token=tokens["b"]) as b:
        first = a.create_session("demo").session_id
        assert w.manager.resident_bytes("tenant-a~") > 0
        with pytest.raises(ResourceExhausted, match=r"may hold .* its budget is 1"):
            a.create_session("demo")
        b.create_session("demo")  # another tenant's bytes are its own
        a.close_session(first)
        assert w.manager.resident_bytes("tenant-a~") == 0
        a.create_session("demo")
