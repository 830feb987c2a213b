"""The committed stubs are exactly what protoc makes from the committed .proto files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTOS = REPO / "protos"
STUBS_ROOT = REPO / "client"


def _generator():  # protos/generate.py is a script, not part of the package
    spec = importlib.util.spec_from_file_location("protos_generate", PROTOS / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stubs_match_protos(tmp_path: Path) -> None:
    generator = _generator()
    generator.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = STUBS_ROOT / rel
        assert committed.exists(), f"{rel} is not committed: run ./dev protos"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), (
            f"{rel} is stale: run ./dev protos"
        )


def test_contract_services_and_messages() -> None:
    from ssmserve.v1 import ssmserve_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["SessionService"]
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert methods == {
        "CreateSession": (False, False),
        "GetSession": (False, False),
        "ListSessions": (False, False),
        "CloseSession": (False, False),
        "Stream": (True, True),
        "Snapshot": (False, False),
        "ListSnapshots": (False, False),
        "Rollback": (False, False),
        "ExportCheckpoint": (False, True),
        "ImportCheckpoint": (True, False),
        "Forecast": (False, True),
        "Fork": (False, False),
        "GetHistory": (False, True),
        "ListModels": (False, False),
        "Upgrade": (False, False),
        "Generate": (False, True),
    }
    request = pb.RollbackRequest(session_id="s", steps_back=3)
    assert request.WhichOneof("target") == "steps_back"
