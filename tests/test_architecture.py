"""The folders show the architecture, and imports run one way between them.

http -> api -> sessions -> cluster -> state -> engine (a layer may import any layer below
it);
``errors`` and ``observability`` are shared by all; ``worker``, ``main`` and ``cli`` wire
everything together.
The client distribution never imports the server (``test_packaging``).
No class passes 400 lines and no module 800, unless ``LONG_CLASSES`` / ``LONG_MODULES``
name it with its own limit; every package's ``__init__`` names each of its modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVER = REPO / "server" / "ssmserve" / "server"
CLIENT = REPO / "client" / "ssmserve" / "client"
LAYERS = ["engine", "state", "cluster", "sessions", "api", "http"]  # bottom to top
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
MAX_MODULE_LINES = 800
#: Classes allowed past MAX_CLASS_LINES, each with its own limit ("path: class"). An
#: entry is the exception: it says what it may not outgrow, and goes once it fits.
LONG_CLASSES: dict[str, int] = {}
#: Modules allowed past MAX_MODULE_LINES, each with its own limit (path).
LONG_MODULES: dict[str, int] = {}
#: The packages whose ``__init__`` docstring maps every module they hold.
MAPPED_PACKAGES = [
    SERVER,
    *(SERVER / name for name in (*LAYERS, "observability")),
    SERVER / "engine" / "gpu",
]


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


def _sources() -> list[Path]:
    return sorted(SERVER.rglob("*.py")) + sorted(CLIENT.rglob("*.py"))


def test_no_class_is_longer_than_its_limit() -> None:
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                name = f"{path.relative_to(REPO)}: {node.name}"
                if lines > LONG_CLASSES.get(name, MAX_CLASS_LINES):
                    long.append(f"{name} ({lines} lines)")
    assert not long, "\n".join(long)


def test_no_module_is_longer_than_its_limit() -> None:
    long = []
    for path in _sources():
        name = str(path.relative_to(REPO))
        lines = len(path.read_text().splitlines())
        if lines > LONG_MODULES.get(name, MAX_MODULE_LINES):
            long.append(f"{name} ({lines} lines)")
    assert not long, "\n".join(long)


def test_the_allow_lists_name_only_what_needs_them() -> None:
    """An entry for a class or module that fits the plain limit (or is gone) goes."""
    sizes: dict[str, int] = {}
    for path in _sources():
        text = path.read_text()
        sizes[str(path.relative_to(REPO))] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                sizes[f"{path.relative_to(REPO)}: {node.name}"] = node.end_lineno - node.lineno + 1
    stale = [
        f"{name} ({sizes.get(name, 0)} lines): remove it from the allow-list"
        for allowed, limit in ((LONG_CLASSES, MAX_CLASS_LINES), (LONG_MODULES, MAX_MODULE_LINES))
        for name in allowed
        if sizes.get(name, 0) <= limit
    ]
    assert not stale, "\n".join(stale)


def test_each_package_init_maps_every_module() -> None:
    """Every module file (and sub-package) of a package is named in its ``__init__``'s
    docstring, as ````name````."""
    unmapped = []
    for package in MAPPED_PACKAGES:
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        names = [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
        names += [p.parent.name for p in package.glob("*/__init__.py")]
        unmapped += [
            f"{(package / '__init__.py').relative_to(REPO)} does not name ``{name}``"
            for name in sorted(names)
            if f"``{name}``" not in doc
        ]
    assert not unmapped, "\n".join(unmapped)
