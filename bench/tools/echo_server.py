"""A bare grpc.aio bidirectional echo server: the gRPC limit the served numbers sit beside.

Raw bytes in, the same bytes out, no protobuf parsing, on a free loopback port; prints
``echo listening on HOST:PORT`` when ready and runs until SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import grpc


async def echo(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
) -> AsyncIterator[bytes]:
    async for message in requests:
        yield message


async def main() -> None:
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"echo listening on 127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(1)


if __name__ == "__main__":
    asyncio.run(main())
