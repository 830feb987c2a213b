"""The folders show the architecture, and imports run one way between them.

http -> api -> sessions -> cluster -> state -> engine (a layer may import any layer below
it);
``errors`` and ``observability`` are shared by all; the server's top-level modules
(``worker``, ``main``, ``cli``, ``offline_commands``, ``supervisor``, ...) wire everything
together, and nothing in a layer or a shared package imports one of them.
No module imports itself back: the import graph of the server's and the client's modules
has no cycle (a package's ``__init__`` is a module of its own; every kind of import
counts: at module level, in a function, under ``TYPE_CHECKING``, relative, and a string
literal passed to ``importlib.import_module``).
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


def _module_name(path: Path) -> str:
    """The dotted name of a source file under ``server/`` or ``client/`` (a package's
    ``__init__`` is named as the package)."""
    parts = path.relative_to(REPO).with_suffix("").parts[1:]  # less the distribution
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


#: Every module of the server and the client, by dotted name.
MODULES = {_module_name(p): p for root in (SERVER, CLIENT) for p in sorted(root.rglob("*.py"))}


def _import_lines(path: Path) -> list[tuple[str, int]]:
    return _import_lines_of(path, _module_name(path))


def _import_lines_of(path: Path, name: str) -> list[tuple[str, int]]:
    """Each ``ssmserve`` module the source ``path`` (module ``name``) imports, with the
    line: ``import x``, ``from x import y`` (``y`` itself where it is a module), relative
    imports resolved, at any depth (in functions, under ``TYPE_CHECKING``), and a string
    literal passed to ``importlib.import_module``."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            if len(subs) < len(node.names):
                found.append((base, node.lineno))
            found += [(sub, node.lineno) for sub in subs]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.args[0].value, node.lineno))
    return [(n, line) for n, line in found if n.startswith("ssmserve.")]


def _imports(path: Path) -> list[str]:
    return [name for name, _ in _import_lines(path)]


def _import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: the first line that does}, between the server's and
    the client's modules."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in MODULES.items():
        edges = graph.setdefault(name, {})
        for target, line in _import_lines(path):
            if target in MODULES and target != name:
                edges.setdefault(target, line)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The graph's strongly connected groups of more than one module (Tarjan's
    algorithm, iterative), each sorted; a group is one or more import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_each_layer_imports_only_layers_below_it() -> None:
    """A layer's modules (its sub-packages' too) import the layers below it and the
    shared packages only: never a layer above, nor a top-level wiring module."""
    wrong = []
    for rank, layer in enumerate(LAYERS):
        allowed = set(LAYERS[: rank + 1]) | SHARED
        for path in sorted((SERVER / layer).rglob("*.py")):
            where = path.relative_to(SERVER)
            for name, line in _import_lines(path):
                if name.startswith(tuple(CLIENT_HELPERS)):
                    continue
                parts = name.split(".")
                if parts[:2] != ["ssmserve", "server"] or len(parts) < 3:
                    wrong.append(f"{where}:{line} imports {name}")
                elif parts[2] in LAYERS and parts[2] not in allowed:
                    wrong.append(f"{where}:{line} imports {name} (a layer above it)")
                elif parts[2] not in allowed:
                    wrong.append(f"{where}:{line} imports {name} (a top-level wiring module)")
    assert not wrong, "\n".join(wrong)


def test_shared_packages_import_no_layer() -> None:
    """``errors`` and ``observability`` import each other and the client's helpers only:
    no layer, no top-level wiring module."""
    paths = [SERVER / "errors.py", *sorted((SERVER / "observability").rglob("*.py"))]
    wrong = []
    for path in paths:
        for name, line in _import_lines(path):
            parts = name.split(".")
            if name.startswith(tuple(CLIENT_HELPERS)):
                continue
            if parts[:2] != ["ssmserve", "server"] or len(parts) < 3 or parts[2] not in SHARED:
                wrong.append(f"{path.relative_to(SERVER)}:{line} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle() -> None:
    """No module of the server or the client imports, through any chain, a module that
    imports it back: what both need lives in a module below both."""
    graph = _import_graph()
    described = []
    for group in _cycles(graph):
        members = set(group)
        edges = [
            f"    {a} -> {b} ({MODULES[a].relative_to(REPO)}:{graph[a][b]})"
            for a in group
            for b in sorted(graph[a])
            if b in members
        ]
        described.append(f"import cycle between {', '.join(group)}:\n" + "\n".join(edges))
    assert not described, "\n".join(described)


def test_the_import_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The rules above read each kind of import, so none slips past them."""
    source = tmp_path / "example.py"
    source.write_text(
        "from __future__ import annotations\n"
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "from ssmserve.server.engine import loader\n"
        "if TYPE_CHECKING:\n"
        "    from ssmserve.server.sessions.session import Session\n"
        "def f() -> None:\n"
        "    from ssmserve.server.cli import ARCHS\n"
        "    importlib.import_module('ssmserve.server.offline_commands')\n"
    )
    assert {name for name, _ in _import_lines_of(source, "ssmserve.server.api.example")} == {
        "ssmserve.server.engine.loader",
        "ssmserve.server.sessions.session",
        "ssmserve.server.cli",
        "ssmserve.server.offline_commands",
    }
    relative = tmp_path / "relative.py"
    relative.write_text("from . import errors\nfrom ..state import store\n")
    assert {name for name, _ in _import_lines_of(relative, "ssmserve.server.sessions.x")} == {
        "ssmserve.server.sessions.errors",
        "ssmserve.server.state.store",
    }
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [
        ["a", "b", "c"]
    ]


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
