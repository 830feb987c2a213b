"""The CLI never throws work away: against a real worker on a real Redis, every way a
command can fail leaves the session where it was or keeps what was answered.

- an output path that cannot be written (missing directory, unwritable directory, a
  directory) is refused before anything is sent: the session's step does not move;
- a stream cut part-way (a bad input, Ctrl-C) saves the outputs of the answered steps and
  says how to go on; going on with ``--first-step`` applies no step twice;
- a write that fails after the work (a full disk) keeps the result in the temp dir;
- a server that is down is reported within seconds, in one line, and nothing is written;
- a wrong session id writes nothing and says how to find the right one.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ssmserve.client.cli import main
from ssmserve.server.state.checkpoint import Checkpoint
from tests.conftest import random_inputs

REPO = Path(__file__).resolve().parent.parent
# A server that is down is reported within a few seconds: the client gives a first
# connection RetryPolicy.connect_timeout_s (2 s), not give_up_after_s (a minute).
DOWN_REPORTED_WITHIN_S = 10.0


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ssmserve: error: "), err
    return lines[0]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def _can_create_in(directory: Path) -> bool:
    try:
        (directory / ".probe").touch()
    except OSError:
        return False
    (directory / ".probe").unlink()
    return True


@pytest.fixture
def unwritable_dir(tmp_path: Path):
    """A directory that refuses new files to this process: one made read-only, or (root
    ignores file modes) /sys, a file system that takes no new files."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    directory.chmod(0o555)
    try:
        if not _can_create_in(directory):
            yield directory
        elif Path("/sys").is_dir() and not _can_create_in(Path("/sys")):
            yield Path("/sys")
        else:
            pytest.skip("no directory here refuses new files to this user")
    finally:
        directory.chmod(0o755)


def _commands(sid: str, inputs: Path, out: Path) -> dict[str, list[str]]:
    """Every command that writes an --output, as argv after ``--server A``."""
    return {
        "session stream": ["session", "stream", sid, "--input", str(inputs), "--output", str(out)],
        "export": ["export", sid, "--output", str(out)],
        "forecast": ["forecast", sid, "--horizon", "3", "--output", str(out)],
        "plot": ["plot", sid, "--output", str(out)],
    }


@pytest.mark.parametrize("command", ["session stream", "export", "forecast", "plot"])
@pytest.mark.parametrize("case", ["missing directory", "unwritable directory", "a directory"])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(
    worker, served_models, tmp_path, capsys, request, command, case
):
    model = served_models["demo"]
    sid = worker.client.create_session("demo").session_id
    list(worker.client.stream_steps(sid, list(random_inputs(model, 5, seed=1))))
    np.save(tmp_path / "in.npy", random_inputs(model, 7, seed=2))
    if case == "missing directory":
        out, why = tmp_path / "no-such-dir" / "out.file", "does not exist; create it first"
    elif case == "unwritable directory":
        directory = request.getfixturevalue("unwritable_dir")
        out, why = directory / "out.png", f"cannot create files in {directory}"
    else:
        out, why = tmp_path, "is a directory; give a file name"
    before = sorted(tmp_path.rglob("*"))

    code, _, err = cli(capsys, "--server", worker.address,
                       *_commands(sid, tmp_path / "in.npy", out)[command])  # fmt: skip

    line = one_error_line(err)
    assert code == 2 and line.startswith(f"ssmserve: error: --output {out}: ") and why in line
    assert worker.client.get_session(sid).step == 5  # nothing was applied
    assert sorted(tmp_path.rglob("*")) == before  # nothing was written


def test_a_stream_cut_by_a_bad_input_keeps_the_answered_outputs_and_goes_on(
    worker, served_models, tmp_path, capsys
):
    model = served_models["demo"]
    sid = worker.client.create_session("demo", snapshot_every=4).session_id
    x = random_inputs(model, 20, seed=3)
    bad = x.copy()
    bad[10, 1] = np.nan  # step 11
    np.save(tmp_path / "bad.npy", bad)
    np.save(tmp_path / "good.npy", x)
    out = tmp_path / "out.npy"

    code, _, err = cli(capsys, "--server", worker.address, "session", "stream", sid,
                       "--input", str(tmp_path / "bad.npy"), "--output", str(out))  # fmt: skip
    line = one_error_line(err)
    assert code == 2 and "step 11: INVALID_ARGUMENT" in line
    assert f"steps 1..10 of 1..20 were answered and their 10 outputs saved in {out}" in line
    assert "run the same command with --first-step 1" in line
    want = model.run(x)[0]
    np.testing.assert_array_equal(bits(np.load(out)), bits(want[:10]))
    assert worker.client.get_session(sid).step == 10

    code, stdout, err = cli(capsys, "--server", worker.address, "session", "stream", sid,
                            "--input", str(tmp_path / "good.npy"), "--output", str(out),
                            "--first-step", "1")  # fmt: skip
    assert code == 0, err
    assert "session " + sid + " at step 20: steps 1..20" in stdout
    np.testing.assert_array_equal(bits(np.load(out)), bits(want))
    assert worker.client.get_session(sid).step == 20  # steps 1..10 were not applied again

    code, _, err = cli(capsys, "--server", worker.address, "session", "stream", sid,
                       "--input", str(tmp_path / "good.npy"), "--output", str(out),
                       "--first-step", "22")  # fmt: skip
    assert code == 2 and "its next step is 21; nothing was sent" in one_error_line(err)


def test_ctrl_c_keeps_the_answered_outputs_and_going_on_applies_no_step_twice(
    worker, served_models, tmp_path
):
    model = served_models["demo"]
    sid = worker.client.create_session("demo").session_id
    # Interrupted at step 500 of 8,000: the stream is far from done when the signal comes
    # (~600 steps/s one per message here; the CLI sees SIGINT within milliseconds).
    x = random_inputs(model, 8_000, seed=4)
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "out.npy"
    argv = [sys.executable, "-m", "ssmserve.client.cli", "--server", worker.address, "session",
            "stream", sid, "--input", str(tmp_path / "in.npy"), "--output", str(out),
            "--steps-per-message", "1"]  # fmt: skip
    # Ctrl-C's default action in the CLI, whatever this process inherited: a test run
    # started in the background of a shell has SIGINT ignored, which its children inherit
    # and Python keeps (the CLI then streamed every step and exited 0).
    proc = subprocess.Popen(
        argv, stderr=subprocess.PIPE, text=True, cwd=REPO,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while worker.client.get_session(sid).step < 500 and proc.poll() is None:
        assert time.monotonic() < deadline, "the stream made no progress"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    answered = len(np.load(out))
    assert f"ssmserve: interrupted; steps 1..{answered} of 1..8000 were answered" in err
    assert "--first-step 1" in err
    want = model.run(x)[0]
    np.testing.assert_array_equal(bits(np.load(out)), bits(want[:answered]))
    assert worker.client.get_session(sid).step >= answered  # sent, maybe not answered

    done = subprocess.run([*argv, "--first-step", "1"], capture_output=True, text=True,
                          timeout=300, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(bits(np.load(out)), bits(want))
    assert worker.client.get_session(sid).step == len(x)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full (a full disk)")
def test_a_write_that_fails_after_the_work_keeps_the_result(
    worker, served_models, tmp_path, capsys
):
    model = served_models["demo"]
    sid = worker.client.create_session("demo").session_id
    x = random_inputs(model, 12, seed=5)
    np.save(tmp_path / "in.npy", x)

    code, _, err = cli(capsys, "--server", worker.address, "session", "stream", sid,
                       "--input", str(tmp_path / "in.npy"), "--output", "/dev/full")  # fmt: skip
    line = one_error_line(err)
    assert code == 2 and "cannot write /dev/full (No space left on device)" in line
    assert "all 12 steps (1..12) were applied: the result is in " in line
    kept = Path(line.rsplit("the result is in ", 1)[1])
    try:
        np.testing.assert_array_equal(bits(np.load(kept)), bits(model.run(x)[0]))
    finally:
        kept.unlink()
    assert worker.client.get_session(sid).step == 12
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)  # written in place, never replaced

    code, _, err = cli(capsys, "--server", worker.address, "export", sid, "--output", "/dev/full")
    line = one_error_line(err)
    assert code == 2 and "the checkpoint (" in line
    kept = Path(line.rsplit("the result is in ", 1)[1])
    try:
        assert Checkpoint.decode(kept.read_bytes()).step == 12
    finally:
        kept.unlink()


def test_a_server_that_is_down_is_reported_within_seconds(
    worker, start_worker, served_models, tmp_path, capsys
):
    model = served_models["demo"]
    sid = worker.client.create_session("demo").session_id
    list(worker.client.stream_steps(sid, list(random_inputs(model, 5, seed=6))))
    np.save(tmp_path / "in.npy", random_inputs(model, 7, seed=7))
    address = worker.address
    worker.stop()  # its sessions stay in Redis; nothing listens at its address now
    out = tmp_path / "out.npy"

    for argv in (
        ["session", "stream", sid, "--input", str(tmp_path / "in.npy"), "--output", str(out)],
        ["session", "list"],
        ["session", "create", "--model", "demo"],
        ["models"],
    ):
        started = time.monotonic()
        code, _, err = cli(capsys, "--server", address, *argv)
        elapsed = time.monotonic() - started
        line = one_error_line(err)
        assert code == 2 and line.startswith(
            f"ssmserve: error: UNAVAILABLE: no ssmserve server at {address}: connection "
            "refused; is it running?"
        ), line
        assert elapsed < DOWN_REPORTED_WITHIN_S, (argv, elapsed)
    assert not out.exists()
    assert start_worker().client.get_session(sid).step == 5  # the step did not move


def test_a_wrong_session_id_writes_nothing_and_says_how_to_find_one(worker, tmp_path, capsys):
    np.save(tmp_path / "in.npy", np.zeros((3, 4), np.float32))
    out = tmp_path / "out.file"
    out.write_text("an older result")
    for argv in (
        ["session", "stream", "nope", "--input", str(tmp_path / "in.npy"), "--output", str(out)],
        ["export", "nope", "--output", str(out)],
        ["forecast", "nope", "--horizon", "2", "--output", str(out)],
    ):
        code, _, err = cli(capsys, "--server", worker.address, *argv)
        assert code == 2 and one_error_line(err) == (
            "ssmserve: error: NOT_FOUND (SESSION_MISSING): session 'nope' does not exist; "
            "`ssmserve session list` shows the sessions there are"
        )
        assert out.read_text() == "an older result"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npy", "out.file"]


def test_the_server_comes_from_ssmserve_server_and_a_bare_host_means_port_50051(
    worker, tmp_path, capsys, monkeypatch
):
    from ssmserve.client.addresses import worker_address

    sid = worker.client.create_session("demo").session_id
    monkeypatch.setenv("SSMSERVE_SERVER", worker.address)
    code, out, err = cli(capsys, "session", "list")
    assert code == 0 and out.split("\t")[0] == sid, err
    monkeypatch.setenv("SSMSERVE_SERVER", "127.0.0.1:1")  # --server wins over it
    code, out, err = cli(capsys, "--server", worker.address, "session", "inspect", sid)
    assert code == 0 and "input     4 floats per step; output 4 floats" in out, err

    code, _, err = cli(capsys, "--server", "nosuchhost.invalid", "session", "list")
    assert code == 2 and "no ssmserve server at nosuchhost.invalid:50051: " in one_error_line(err)
    assert worker_address("localhost") == "localhost:50051"
    assert worker_address(" [::1] ") == "[::1]:50051"
    for written in ("localhost:7", "[::1]:7", "unix:/run/ssmserve.sock", "dns:///h:7", "::1"):
        assert worker_address(written) == written
