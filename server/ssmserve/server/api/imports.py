"""CheckpointUpload: an ImportCheckpoint stream received into Redis, not into memory.

A checkpoint may be up to ``max_import_bytes`` (1 GiB) and a client may send it slowly.
Held in memory meanwhile, a few slow imports would pin gigabytes of a worker. Instead the
chunks are gathered into pieces of about 1 MiB (whatever size the client's chunks are)
and each piece is appended to a staging list in Redis (``store_layout.upload_key``), which
expires ``stage_ttl_s`` after its newest piece. The worker holds one piece at a time.

Only when the last chunk has arrived and every check on the stream passed is the
checkpoint read back whole, to be decoded; that read is counted in the worker's memory
budget by the caller (``sessions.memory``). The staging list is dropped however the
import ends.

Message rules (``ImportCheckpointRequest``): one header first, then chunks numbered from
0, each at most 1 MiB, all declaring the same total size, the last one marked ``last``.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Callable

from ssmserve.server.errors import ErrorKind, SsmserveError
from ssmserve.server.state.import_staging import ImportStaging
from ssmserve.server.state.store_errors import StagedPiecesMissingError
from ssmserve.v1 import ssmserve_pb2 as pb

CHUNK_BYTES = 1 << 20  # checkpoint chunks are at most 1 MiB (the contract)
PIECE_BYTES = 1 << 20  # chunks are gathered into staging pieces of at least this much


class RequestError(SsmserveError):
    """A request that is malformed as a message (INVALID_ARGUMENT)."""


class ImportTooLargeError(SsmserveError):
    kind = ErrorKind.RESOURCE_EXHAUSTED


class CheckpointUpload:
    """One import's chunks, staged in Redis as they arrive."""

    def __init__(
        self, store: ImportStaging, max_bytes: int, reserve: Callable[[int], None]
    ) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self.reserve = reserve  # told the declared size before anything is staged
        self.upload_id = secrets.token_hex(16)
        self.header: pb.ImportHeader | None = None
        self.total = -1  # bytes declared by the chunks
        self.received = 0
        self.pieces = 0  # staged in Redis
        self._pending: list[bytes] = []  # chunks not staged yet (less than a piece)
        self._pending_bytes = 0

    async def receive(self, requests: AsyncIterator[pb.ImportCheckpointRequest]) -> None:
        """Read the whole stream, staging its chunks; RequestError on any broken rule."""
        chunks, done = 0, False
        async for request in requests:
            which = request.WhichOneof("part")
            if which == "header":
                if self.header is not None:
                    raise RequestError("import: the header was sent twice")
                self.header = request.header
                continue
            if which != "chunk":
                raise RequestError("import: a message carries neither a header nor a chunk")
            if self.header is None:
                raise RequestError("import: the first message must be the header")
            chunk = request.chunk
            if done:
                raise RequestError(f"import: chunk {chunk.index} arrived after the last chunk")
            if chunk.index != chunks:
                raise RequestError(
                    f"import: chunk {chunk.index} arrived where chunk {chunks} was expected"
                )
            self._check_total(chunk)
            if len(chunk.data) > CHUNK_BYTES:
                raise RequestError(
                    f"import: chunk {chunk.index} holds {len(chunk.data)} bytes, over 1 MiB"
                )
            self.received += len(chunk.data)
            if self.received > self.total:
                raise RequestError(
                    f"import: the chunks hold more than the {self.total} bytes declared"
                )
            await self._add(chunk.data)
            chunks += 1
            done = chunk.last
        if self.header is None:
            raise RequestError("import: the stream ended before the header")
        if not done:
            raise RequestError(
                f"import: the stream ended after chunk {chunks - 1} without the last chunk"
            )
        if self.received != self.total:
            raise RequestError(
                f"import: got {self.received} bytes, the chunks declared {self.total}"
            )
        await self._flush()

    def _check_total(self, chunk: pb.CheckpointChunk) -> None:
        if self.total < 0:
            if chunk.total_size > self.max_bytes:
                raise ImportTooLargeError(
                    f"import: a checkpoint of {chunk.total_size} bytes is over the limit of "
                    f"{self.max_bytes}"
                )
            self.reserve(chunk.total_size)
            self.total = chunk.total_size
        elif chunk.total_size != self.total:
            raise RequestError(
                f"import: chunk {chunk.index} says the total is {chunk.total_size} bytes, "
                f"chunk 0 said {self.total}"
            )

    async def _add(self, data: bytes) -> None:
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= PIECE_BYTES:
            await self._flush()

    async def _flush(self) -> None:
        if not self._pending:
            return
        piece = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending, self._pending_bytes = [], 0
        length = await self.store.stage_upload_piece(self.upload_id, piece)
        self.pieces += 1
        if length != self.pieces:  # expired between two pieces, or a piece was lost
            raise StagedPiecesMissingError(
                f"import: the staging list in Redis holds {length} pieces where {self.pieces} "
                f"were sent (it expires {self.store.settings.stage_ttl_s} s after a piece)"
            )

    async def read(self) -> memoryview:
        """The checkpoint's bytes, whole (read-only)."""
        return await self.store.read_upload(self.upload_id, self.pieces, self.total)

    async def drop(self) -> None:
        """Delete the staging list (best effort: it expires anyway)."""
        if self.pieces:
            with contextlib.suppress(SsmserveError):
                await self.store.drop_upload(self.upload_id)
