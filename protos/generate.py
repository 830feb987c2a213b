"""Regenerate the Python stubs from the .proto files: ``./dev protos``.

The generated modules are committed (so installing ssmserve needs no protoc) in the
client's distribution, ``client/ssmserve/v1/`` (``ssmserve-client`` ships them; the
server uses them from there); ``tests/test_protos.py`` fails when they drift from the
.proto files.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTOS = Path(__file__).resolve().parent
STUBS_ROOT = PROTOS.parent / "client"  # stubs land in client/ssmserve/v1/
SOURCES = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.glob("ssmserve/**/*.proto"))


def generate(out_dir: Path) -> None:
    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *SOURCES,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {SOURCES}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else STUBS_ROOT)
