"""The folders show the architecture, and imports run one way between them.

api -> sessions -> cluster -> state -> engine (a layer may import any layer below it);
``errors`` and ``observability`` are shared by all; ``worker``, ``main`` and ``cli`` wire
everything together.
The client distribution never imports the server (``test_packaging``).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVER = REPO / "server" / "ssmserve" / "server"
CLIENT = REPO / "client" / "ssmserve" / "client"
LAYERS = ["engine", "state", "cluster", "sessions", "api"]  # bottom to top
# Typed errors with a kind (every layer raises them) and observability (every layer
# counts and logs); neither imports a layer.
SHARED = {"errors", "observability"}
CLIENT_HELPERS = {
    "ssmserve.client.atomic_file",
    "ssmserve.client.tls",
    "ssmserve.client.step_values",  # the wire's Vector decoded one way on both sides
    "ssmserve.client.stall_bound",  # a streaming call's replies each within a bound
    "ssmserve.v1",
}  # the server builds on these
MAX_CLASS_LINES = 400


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return [n for n in names if n.startswith("ssmserve.")]


def test_each_layer_imports_only_layers_below_it() -> None:
    wrong = []
    for rank, layer in enumerate(LAYERS):
        allowed = set(LAYERS[: rank + 1]) | SHARED
        for path in sorted((SERVER / layer).glob("*.py")):
            for name in _imports(path):
                if name.startswith(tuple(CLIENT_HELPERS)):
                    continue
                parts = name.split(".")
                if parts[:2] != ["ssmserve", "server"] or len(parts) < 3:
                    wrong.append(f"{layer}/{path.name} imports {name}")
                elif parts[2] not in allowed:
                    wrong.append(f"{layer}/{path.name} imports {name} (a layer above it)")
    assert not wrong, "\n".join(wrong)


def test_shared_packages_import_no_layer() -> None:
    paths = [SERVER / "errors.py", *sorted((SERVER / "observability").glob("*.py"))]
    wrong = [
        f"{path.relative_to(SERVER)} imports {name}"
        for path in paths
        for name in _imports(path)
        if name.split(".")[2:3] and name.split(".")[2] in LAYERS
    ]
    assert not wrong, "\n".join(wrong)


def test_no_class_is_longer_than_the_limit_without_a_reason() -> None:
    long = []
    for path in sorted(SERVER.rglob("*.py")) + sorted(CLIENT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                doc = ast.get_docstring(node) or ""
                if lines > MAX_CLASS_LINES and "Why this class is long" not in doc:
                    long.append(f"{path.relative_to(REPO)}: {node.name} ({lines} lines)")
    assert not long, "\n".join(long)
