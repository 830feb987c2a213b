"""Operator mistakes on one machine are refused at start, with a message naming the clash:
a taken listen port, a data directory a live worker holds, an advertised address a live
worker of the same Redis uses. And the embedded Redis's password never reaches the log.
Real worker processes on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ssmserve.client.sync import Client
from ssmserve.server.data_dir_lock import DataDirInUseError, DataDirLock, DataDirLockSettings
from tests.worker_process import WorkerProcess


def run_worker(args: list[str], timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    """A worker that is expected not to start: its exit code and output (one that starts
    anyway is stopped, and its exit code is -1)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ssmserve.server.main", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "SSMSERVE_LOG_LEVEL": "WARNING"},
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:  # it serves: "listening on" is all it printed
        proc.kill()
        out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, -1, out, err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_second_worker_on_a_taken_port_is_refused(worker, model_dirs, tmp_path):
    """gRPC's default SO_REUSEPORT would let the second one bind and take half of the
    new connections; with it off, the second one is refused and says why. (The second
    runs its own Redis, as two workers started side by side on one machine would.)"""
    port = worker.address.rsplit(":", 1)[1]
    second = run_worker(
        ["--listen", worker.address, "--data-dir", str(tmp_path),
         "--model", f"demo={model_dirs['demo']}"],
        timeout_s=20,
    )  # fmt: skip
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"port {port} is already in use (another ssmserve worker?)" in second.stderr
    assert "pick another --listen or stop it" in second.stderr
    assert worker.client.create_session("demo").session_id  # the first one serves on


def test_a_data_dir_held_by_a_live_worker_is_refused(model_dirs, tmp_path):
    """Two embedded Redis servers on one AOF would corrupt it: the second worker is refused
    naming the directory and the pid that holds it. A worker that was killed leaves no
    lock behind: started again on the same directory, it starts."""
    data = tmp_path / "data"
    first = WorkerProcess({"demo": model_dirs["demo"]}, None, data).start()
    try:
        assert first.proc is not None
        second = run_worker(
            ["--listen", "127.0.0.1:0", "--data-dir", str(data),
             "--model", f"demo={model_dirs['demo']}"]
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert f"--data-dir {data} is in use by process {first.proc.pid}" in second.stderr
        assert "pick another --data-dir" in second.stderr
        with Client(first.address) as client:
            sid = client.create_session("demo").session_id
        first.kill()  # its redis-server goes with it (SIGTERM from the kernel, on Linux)
        started = time.monotonic()
        first.start()
        assert time.monotonic() - started < 20
        with Client(first.address) as client:
            assert client.get_session(sid).step == 0  # the same store, from its AOF
    finally:
        first.kill()


def test_an_advertised_address_of_a_live_worker_is_refused(model_dirs, redis_url, tmp_path):
    """Two workers advertising one address would send sessions' clients in circles: the
    second is refused, naming the worker that has it. A worker killed and started again
    with its own address waits out its old registry entry (at most one worker TTL)."""
    first = WorkerProcess({"demo": model_dirs["demo"]}, redis_url, tmp_path / "a")
    shared = ("--advertise", first.address)
    first.extra_args = shared
    first.start()
    try:
        second = WorkerProcess(
            {"demo": model_dirs["demo"]}, redis_url, tmp_path / "b", extra_args=shared
        )
        with pytest.raises(RuntimeError, match="did not start"):
            second.start()
        log = second.log_text()
        assert f"already advertises {first.address} in this Redis" in log
        assert "Give each worker its own --advertise" in log
        first.kill()
        first.start()  # its own entry, dead: waited out
        assert "already advertises" not in first.log_text()
    finally:
        first.kill()


def test_the_embedded_redis_password_is_never_logged(model_dirs, tmp_path):
    data = tmp_path / "data"
    worker = WorkerProcess(
        {"demo": model_dirs["demo"]}, None, data, env={"SSMSERVE_LOG_LEVEL": "DEBUG"}
    ).start()
    try:
        config = (data / "redis" / "redis.conf").read_text()
        password = config.split("requirepass", 1)[1].split()[0]
        assert len(password) >= 24
        worker.terminate()
        log = worker.log_text()
        assert "embedded redis-server on 127.0.0.1:" in log
        assert password not in log
    finally:
        worker.kill()


def test_a_lock_names_the_live_process_that_holds_it(tmp_path: Path) -> None:
    held = DataDirLock(DataDirLockSettings(data_dir=tmp_path)).acquire()
    try:
        with pytest.raises(DataDirInUseError, match=f"in use by process {os.getpid()}"):
            DataDirLock(DataDirLockSettings(data_dir=tmp_path)).acquire()
    finally:
        held.release()
    DataDirLock(DataDirLockSettings(data_dir=tmp_path)).acquire().release()  # free again
