"""The CLI's service commands, in the exact forms of the contract, against a real worker;
and ``ssmserve-server`` as a process: embedded Redis, ready line, clean SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ssmserve.client.cli import main
from ssmserve.client.sync import Client
from ssmserve.server.state.checkpoint import Checkpoint
from tests.conftest import random_inputs


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_session_lifecycle_through_the_cli(worker, served_models, tmp_path, capsys):
    a = worker.address
    model = served_models["demo"]
    x = random_inputs(model, 12, seed=20)
    np.save(tmp_path / "in.npy", x)

    code, out, _ = cli(
        capsys, "--server", a, "session", "create", "--model", "demo", "--snapshot-every", "4",
        "--max-snapshots", "8", "--guard", "check=range,min=-50,max=50,action=report",
    )  # fmt: skip
    assert code == 0
    sid = last_line(out)

    code, out, _ = cli(
        capsys,
        "--server",
        a,
        "session",
        "stream",
        sid,
        "--input",
        str(tmp_path / "in.npy"),
        "--output",
        str(tmp_path / "out.npy"),
    )
    assert code == 0, out
    got = np.load(tmp_path / "out.npy")
    np.testing.assert_array_equal(got.view(np.uint32), model.run(x)[0].view(np.uint32))

    code, out, _ = cli(capsys, "--server", a, "session", "inspect", sid, "--json")
    info = json.loads(out)
    assert (info["step"], info["config"]["snapshotEvery"]) == ("12", 4)
    code, out, _ = cli(capsys, "--server", a, "session", "inspect", sid)
    assert "step      12" in out and "range-0" in out

    code, out, _ = cli(capsys, "--server", a, "snapshot", sid, "--label", "here")
    snap_id = last_line(out)
    code, out, _ = cli(capsys, "--server", a, "snapshots", sid)
    assert snap_id in out and "here" in out

    for flags, step in (
        (["--to-label", "here"], 12),
        (["--to-snapshot", snap_id], 12),
        (["--back", "2"], 10),
        (["--to-step", "9"], 9),
    ):
        code, out, _ = cli(capsys, "--server", a, "rollback", sid, *flags)
        assert code == 0 and f"is at step {step}" in out

    code, out, _ = cli(capsys, "--server", a, "export", sid, "--output", str(tmp_path / "s.ckpt"))
    assert code == 0
    assert Checkpoint.decode((tmp_path / "s.ckpt").read_bytes()).step == 9
    code, out, _ = cli(
        capsys, "--server", a, "import", "--input", str(tmp_path / "s.ckpt"), "--session", "copy"
    )
    assert code == 0 and last_line(out) == "copy"
    # The old spellings still work, and say what to write instead.
    code, _, err = cli(capsys, "--server", a, "export", sid, "--out", str(tmp_path / "o.ckpt"))
    assert code == 0 and "--out is deprecated; use --output" in err
    assert Checkpoint.decode((tmp_path / "o.ckpt").read_bytes()).step == 9
    code, out, err = cli(
        capsys, "--server", a, "import", "--in", str(tmp_path / "o.ckpt"), "--session", "copy2"
    )
    assert code == 0 and last_line(out) == "copy2" and "use --input" in err

    code, out, _ = cli(capsys, "--server", a, "session", "list")
    assert {line.split("\t")[0] for line in out.strip().splitlines()} == {sid, "copy", "copy2"}
    code, out, _ = cli(capsys, "--server", a, "session", "close", sid)
    assert code == 0 and "closed" in out


def test_cli_errors_are_one_line(worker, tmp_path, capsys):
    a = worker.address
    code, _, err = cli(capsys, "--server", a, "session", "inspect", "nope")
    # A worker's error names its status code and reason; a local one is the message alone.
    assert code == 2 and err == (
        "ssmserve: error: NOT_FOUND (SESSION_MISSING): session 'nope' does not exist; "
        "`ssmserve session list` shows the sessions there are\n"
    )
    code, _, err = cli(capsys, "--server", a, "rollback", "nope", "--to-step", "1")
    assert code == 2 and err.startswith("ssmserve: error: NOT_FOUND (") and "does not exist" in err
    code, _, err = cli(capsys, "session", "list")
    assert code == 2 and "--server HOST[:PORT]" in err and "SSMSERVE_SERVER" in err
    sid = worker.client.create_session("demo").session_id
    np.save(tmp_path / "bad.npy", np.zeros((3, 5), np.float32))
    code, _, err = cli(
        capsys,
        "--server",
        a,
        "session",
        "stream",
        sid,
        "--input",
        str(tmp_path / "bad.npy"),
        "--output",
        str(tmp_path / "o.npy"),
    )
    assert code == 2 and "expected shape (T, 4)" in err
    assert not (tmp_path / "o.npy").exists()
    np.save(tmp_path / "nan.npy", np.array([[0, 0, 0, 0], [0, np.nan, 0, 0]], np.float32))
    code, _, err = cli(
        capsys,
        "--server",
        a,
        "session",
        "stream",
        sid,
        "--input",
        str(tmp_path / "nan.npy"),
        "--output",
        str(tmp_path / "o.npy"),
    )
    # The step answered before the bad one is kept (see test_cli_outputs.py).
    assert code == 2 and "NaN" in err and "steps 1..1 of 1..2 were answered" in err
    assert len(err.splitlines()) == 1 and len(np.load(tmp_path / "o.npy")) == 1
    code, _, err = cli(
        capsys, "--server", a, "session", "create", "--model", "demo", "--guard", "check=odd"
    )
    assert code == 2 and "check must be one of finite, range, rate, prediction_error" in err


def test_server_process_starts_serves_and_stops_on_sigterm(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "ssmserve.server.main", "--demo", "--listen", "127.0.0.1:0",
         "--data-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "SSMSERVE_LOG_LEVEL": "WARNING"},
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("ssmserve-server listening on "), proc.stderr.read()
        address = line.split()[-1]
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert _redis_running_in(tmp_path / "redis")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert any((tmp_path / "redis").glob("appendonly*"))  # AOF was on
        assert not _redis_running_in(tmp_path / "redis")  # the embedded Redis stopped too
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _redis_running_in(data_dir: Path) -> bool:
    """Is a process working in this dir alive? redis-server chdirs into its --dir (and
    rewrites its command line, so that cannot be read)."""
    want = data_dir.resolve()
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if cwd.resolve(strict=True) == want:
                return True
        except OSError:
            continue
    return False


def test_server_refuses_to_start_without_models(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ssmserve.server.main", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "SSMSERVE_MODELS"},
    )  # fmt: skip
    assert proc.returncode != 0
    assert "no model to serve" in proc.stderr
    assert not Path(tmp_path / "redis").exists()


def test_cluster_commands_workers_migrate_drain(start_worker, served_models, tmp_path, capsys):
    """workers / migrate / drain, and `session stream` pointed at the old owner."""
    a, b = start_worker(), start_worker()
    model = served_models["demo"]
    x = random_inputs(model, 12, seed=21)
    np.save(tmp_path / "first.npy", x[:6])
    np.save(tmp_path / "rest.npy", x[6:])
    sid = a.client.create_session("demo").session_id
    a.client.create_session("demo")

    code, out, _ = cli(capsys, "--server", b.address, "workers")
    assert code == 0
    rows = [line.split("\t") for line in out.strip().splitlines()]
    assert sorted(r[0] for r in rows) == sorted([a.address, b.address])
    assert {r[0]: r[3] for r in rows}[a.address] in ("2 sessions", "0 sessions")  # heartbeat lag
    code, out, _ = cli(capsys, "--server", a.address, "workers", "--json")
    assert {w["address"] for w in json.loads(out)} == {a.address, b.address}

    out_file = str(tmp_path / "out1.npy")
    assert cli(capsys, "--server", a.address, "session", "stream", sid, "--input",
               str(tmp_path / "first.npy"), "--output", out_file)[0] == 0  # fmt: skip
    code, out, _ = cli(capsys, "--server", b.address, "migrate", sid, "--to", b.address)
    assert code == 0 and f"from {a.address} to {b.address} at step 6" in out
    # pointed at the old owner, the stream simply works
    out_file2 = str(tmp_path / "out2.npy")
    code, out, err = cli(capsys, "--server", a.address, "session", "stream", sid, "--input",
                         str(tmp_path / "rest.npy"), "--output", out_file2)  # fmt: skip
    assert code == 0, err
    got = np.concatenate([np.load(out_file), np.load(out_file2)])
    np.testing.assert_array_equal(got.view(np.uint32), model.run(x)[0].view(np.uint32))

    code, out, err = cli(capsys, "--server", a.address, "migrate", sid, "--to", "127.0.0.1:1")
    assert code == 2 and "no live worker is registered at '127.0.0.1:1'" in err

    code, out, _ = cli(capsys, "--server", b.address, "drain")
    lines = out.strip().splitlines()
    assert code == 0 and lines[-1] == f"drained {b.address}: 1 sessions"
    assert lines[0] == f"[1/1] {sid} -> {a.address}"
    assert a.client.get_session(sid).owner == a.address
    # A drain can be undone (here relayed through A): B takes sessions again.
    assert any(w.draining for w in a.client.list_workers() if w.address == b.address)
    with Client(b.address, discover=False) as only_b:
        assert only_b.create_session("demo").owner == a.address  # B sends creates away
    code, out, err = cli(capsys, "--server", a.address, "undrain", b.address)
    assert code == 0 and out.strip() == f"{b.address} serves again (draining: false)", err
    assert not any(w.draining for w in a.client.list_workers())
    with Client(b.address, discover=False) as only_b:
        assert only_b.create_session("demo").owner == b.address


def test_forecast_and_fork_through_the_cli(worker, served_models, tmp_path, capsys):
    a = worker.address
    model = served_models["demo"]
    x = random_inputs(model, 12, seed=21)
    sid = worker.client.create_session("demo", snapshot_every=4).session_id
    list(worker.client.stream_steps(sid, list(x)))

    out_file = tmp_path / "fc.npy"
    code, out, _ = cli(
        capsys, "--server", a, "forecast", sid, "--horizon", "7", "--at-step", "10",
        "--output", str(out_file),
    )  # fmt: skip
    assert code == 0, out
    assert "7 steps from step 10" in last_line(out)
    expected = worker.client.forecast(sid, 7, at_step=10).outputs
    np.testing.assert_array_equal(np.load(out_file).view(np.uint32), expected.view(np.uint32))
    code, out, _ = cli(capsys, "--server", a, "forecast", sid, "--horizon", "2")
    assert code == 0 and out.startswith("step 13: ") and "step 14: " in out

    code, out, _ = cli(capsys, "--server", a, "fork", sid, "--at-step", "6")
    assert code == 0, out
    fork = last_line(out)
    assert worker.client.get_session(fork).step == 6
    label_snap = worker.client.snapshot(sid, label="here")
    code, out, _ = cli(capsys, "--server", a, "fork", sid, "--at-label", "here")
    assert code == 0 and worker.client.get_session(last_line(out)).step == label_snap.step
    code, out, _ = cli(capsys, "--server", a, "fork", sid, "--at-snapshot", label_snap.snapshot_id)
    assert code == 0 and worker.client.get_session(last_line(out)).step == 12

    code, _, err = cli(capsys, "--server", a, "fork", sid, "--at-step", "99")
    assert code == 2 and "at step 99: it is at step 12" in err and len(err.splitlines()) == 1
    for argv, message in (
        (("forecast", sid, "--horizon", "0"), "must be >= 1"),
        (("fork", sid), "one of the arguments --at-step --at-snapshot --at-label is required"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["--server", a, *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_every_option_of_every_command_has_a_help_text():
    import argparse

    from ssmserve.client.cli import build_parser
    from ssmserve.server.main import build_parser as server_parser

    missing = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not action.help and not isinstance(action, argparse._HelpAction):
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "ssmserve")
    walk(server_parser(), "ssmserve-server")
    assert missing == []


def test_long_commands_report_progress_and_speak_json(
    start_worker, served_models, tmp_path, capsys
):
    import io

    from ssmserve.client.progress import ProgressBar

    a, b = start_worker(), start_worker()
    sid = a.client.create_session("demo").session_id
    a.client.stream_steps(sid, list(random_inputs(served_models["demo"], 5, seed=22)))
    seen: list[tuple[int, int]] = []
    blob = a.client.export_checkpoint(sid, progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1] == (len(blob), len(blob))
    sent: list[tuple[int, int]] = []
    a.client.import_checkpoint(
        blob, "copy", progress=lambda done, total: sent.append((done, total))
    )
    assert sent[-1] == (len(blob), len(blob))

    out_file = tmp_path / "ckpt.bin"
    code, out, err = cli(capsys, "--server", a.address, "export", sid, "--output",
                         str(out_file), "--json")  # fmt: skip
    assert code == 0 and json.loads(out) == {"session_id": sid, "bytes": len(blob),
                                             "path": str(out_file)}  # fmt: skip
    assert err == ""  # no bar when stderr is not a terminal
    code, out, _ = cli(capsys, "--server", a.address, "import", "--input", str(out_file),
                       "--session", "copy2", "--json")  # fmt: skip
    assert code == 0 and json.loads(out)["sessionId"] == "copy2"
    code, out, _ = cli(capsys, "--server", a.address, "migrate", sid, "--to", b.address, "--json")
    assert code == 0 and json.loads(out)["target"] == b.address
    code, out, _ = cli(capsys, "--server", a.address, "drain", a.address, "--json")
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert code == 0 and {p["sessionId"] for p in lines} == {"copy", "copy2"}
    assert lines[-1]["done"] == lines[-1]["total"] == 2

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    bar = ProgressBar("export", "bytes", stream=screen)
    for done in (0, 1 << 20, 3 << 20, 4 << 20):
        bar(done, 4 << 20)
    bar.close()
    assert screen.getvalue().endswith("export [" + "#" * 30 + "] 100% 4.0/4.0 MiB\n")
    assert ProgressBar("x", stream=io.StringIO()).enabled is False


def test_the_demo_runs_against_two_running_workers(redis_url, tmp_path, capsys):
    """deploy/compose.yaml's demo service: ``ssmserve-demo --server A,B`` against two
    ``ssmserve-server --demo`` processes on one Redis; both then stop cleanly on SIGTERM."""
    from ssmserve.client import demo
    from tests.worker_process import WorkerProcess

    workers = [
        WorkerProcess({}, redis_url, tmp_path / name, lease_ttl_s=5.0, extra_args=("--demo",))
        for name in ("a", "b")
    ]
    try:
        for w in workers:
            w.start()
        servers = ",".join(w.address for w in workers)
        code = demo.main(["--server", servers, "--steps", "64", "--plot", str(tmp_path / "p.png")])
        out = capsys.readouterr().out
        assert code == 0, out
        assert "bit" in out and "starting ssmserve-server" not in out  # used the running ones
        assert [w.terminate() for w in workers] == [0, 0]
    finally:
        for w in workers:
            w.kill()
