"""The blocking client: :class:`~ssmserve.client.aio.AsyncClient`'s methods, called synchronously.

    with Client("127.0.0.1:50051") as client:
        info = client.create_session("demo")
        for out in client.stream_steps(info.session_id, signal):
            ...

One implementation serves both APIs: the async client runs on a private event loop in a
background thread, and each call here waits for its result there. Async iterators
(``stream_steps``) come back as ordinary iterators.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

from ssmserve.client.aio import DEFAULT_MAX_MESSAGE, AsyncClient
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.tls import TlsConfig

T = TypeVar("T")


class Client:
    """Every public method of :class:`AsyncClient`, blocking."""

    def __init__(
        self,
        address: str | Sequence[str],
        max_message_bytes: int = DEFAULT_MAX_MESSAGE,
        *,
        retry: RetryPolicy | None = None,
        discover: bool = True,
        tls: TlsConfig | None = None,
        token: str | None = None,
    ) -> None:
        self.address = address if isinstance(address, str) else address[0]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"ssmserve-client[{self.address}]", daemon=True
        )
        self._thread.start()

        async def make() -> AsyncClient:
            return AsyncClient(
                address, max_message_bytes, retry=retry, discover=discover, tls=tls, token=token
            )

        self._aio = self._run(make())

    @property
    def addresses(self) -> list[str]:
        """Every worker this client knows (given, redirected to, or discovered)."""
        return list(self._aio.addresses)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        target = getattr(self._aio, name)
        if name.startswith("_") or not callable(target):
            raise AttributeError(name)

        @functools.wraps(target)
        def call(*args: Any, **kwargs: Any) -> Any:
            result = target(*args, **kwargs)
            if isinstance(result, AsyncIterator):
                return self._iterate(result)
            if asyncio.iscoroutine(result):
                return self._run(result)
            return result

        return call

    def _iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            close = getattr(agen, "aclose", None)
            if close is not None and not self._loop.is_closed():
                self._run(close())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._aio.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
