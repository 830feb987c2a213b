"""ImportCheckpoint's chunks staged in Redis as they arrive (``api.imports``): one list
per upload, private to it (its id is new), expiring ``stage_ttl_s`` after its newest
piece, read back whole once the last chunk is in."""

from __future__ import annotations

from typing import Any

from ssmserve.server.state import store_layout as layout
from ssmserve.server.state.store_calls import StoreCalls
from ssmserve.server.state.store_errors import StagedPiecesMissingError


class ImportStaging(StoreCalls):
    """The store's staging of imported checkpoints (``Store`` has these methods)."""

    async def stage_upload_piece(self, upload_id: str, piece: bytes | memoryview) -> int:
        """Append a piece of an imported checkpoint to its staging list, which expires
        ``stage_ttl_s`` after its newest piece; the list's length after it."""
        key = layout.upload_key(self.settings.key_prefix, upload_id)

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.rpush(key, piece)
                pipe.pexpire(key, self.settings.stage_ttl_s * 1000)
                return await pipe.execute()

        # The list is private to one import (its id is new): a lost answer shows as a
        # wrong length at the next piece or at read-back, never as a wrong checkpoint.
        return int((await self._call("stage_upload_piece", run))[0])

    async def read_upload(self, upload_id: str, pieces: int, size: int) -> memoryview:
        """The staged checkpoint, whole: ``size`` bytes from ``pieces`` pieces (read
        a few at a time into one buffer, so it is held once)."""
        key = layout.upload_key(self.settings.key_prefix, upload_id)
        buffer, offset = bytearray(size), 0
        for start in range(0, pieces, 8):
            stop = min(start + 8, pieces) - 1
            got = await self._call(
                "read_upload", lambda s=start, e=stop: self.redis.lrange(key, s, e)
            )
            if len(got) != stop - start + 1:
                raise StagedPiecesMissingError(
                    f"the staged import lost pieces ({start + len(got)} of {pieces} left): it "
                    f"took longer than {self.settings.stage_ttl_s} s between two chunks"
                )
            for piece in got:
                if offset + len(piece) > size:
                    raise StagedPiecesMissingError(f"the staged import holds over {size} bytes")
                buffer[offset : offset + len(piece)] = piece
                offset += len(piece)
        if offset != size:
            raise StagedPiecesMissingError(f"the staged import holds {offset} bytes, not {size}")
        return memoryview(buffer).toreadonly()

    async def drop_upload(self, upload_id: str) -> None:
        key = layout.upload_key(self.settings.key_prefix, upload_id)
        await self._call("drop_upload", lambda: self.redis.unlink(key))
