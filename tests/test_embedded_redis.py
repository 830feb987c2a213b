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
