"""Keeps the embedded redis-server running: restarted from its AOF when it dies.

A redis-server can die under its owner (the kernel's OOM killer, a crash, an operator's
``kill``). The owner, a worker or the ``--workers`` supervisor, keeps one
:class:`EmbeddedRedisKeeper` on its event loop: it notices the exit within
``check_every_s`` and starts redis-server again on the same port with the same password
and data directory, so the AOF brings back every write Redis had taken (an acknowledged
write is in the AOF file before Redis answers; only an OS crash inside
``appendfsync everysec`` loses the last second). Clients of the store reconnect on their
own. Restarts back off (``restart_backoff``) and each one is counted
(``ssmserve_embedded_redis_restarts_total``) and logged, never with the password.

Why a task on the owner's event loop and not a thread inside ``EmbeddedRedis``: the
restart counter is a loop-only metric (``observability.loop_metrics``), the owner must
stop the keeper before it stops Redis on purpose (one loop orders the two), and on Linux
the redis-server dies with the thread that started it: the loop thread lives as long as
its process, a helper thread may not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisError
from ssmserve.server.restart_backoff import BackoffSettings, RestartBackoff

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeeperSettings:
    check_every_s: float = 0.1  # how soon a dead redis-server is noticed (one waitpid)
    backoff: BackoffSettings = field(default_factory=BackoffSettings)


class EmbeddedRedisKeeper:
    """``on_restart`` is called (on the loop) after each successful restart."""

    def __init__(
        self,
        redis: EmbeddedRedis,
        settings: KeeperSettings,
        on_restart: Callable[[], None] = lambda: None,
    ) -> None:
        self.redis = redis
        self.settings = settings
        self.on_restart = on_restart
        self.restarts = 0
        self._backoff = RestartBackoff(settings.backoff)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._backoff.started()
        self._task = asyncio.create_task(self._keep(), name="embedded-redis-keeper")

    async def stop(self) -> None:
        """Stop watching (before the owner stops Redis on purpose)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self.settings.check_every_s)
            code = self.redis.exit_code
            if code is None:
                continue
            log.error(
                "the embedded redis-server (port %d) exited (%s); the store is unavailable "
                "until it is restarted from its AOF. Its log ends: %s",
                self.redis.port, _how(code), self.redis.log_tail() or "(empty)",
            )  # fmt: skip
            while not await self._restart(self._backoff.delay()):
                pass

    async def _restart(self, delay: float) -> bool:
        await asyncio.sleep(delay)
        try:
            self.redis.spawn()  # on the loop thread: see the module's docstring
        except (OSError, EmbeddedRedisError) as exc:
            log.error("the embedded redis-server could not be started again: %s", exc)
            return False
        if not await asyncio.to_thread(self.redis.wait_ready):
            error = await asyncio.to_thread(self.redis.start_failure)
            log.error("the embedded redis-server could not be started again: %s", error)
            return False
        self._backoff.started()
        self.restarts += 1
        log.warning(
            "the embedded redis-server runs again on port %d (restart %d, after %.1f s of "
            "backoff), from its AOF",
            self.redis.port, self.restarts, delay,
        )  # fmt: skip
        self.on_restart()
        return True


def _how(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            name = signal.Signals(-code).name
            hint = " (the OOM killer, or kill -9)" if name == "SIGKILL" else ""
            return f"killed by {name}{hint}"
        return f"killed by signal {-code}"
    return f"exit code {code}"
