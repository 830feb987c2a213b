"""A session's config as Redis holds it is untrusted bytes: one that does not decode is
that session's DATA_LOSS, named, and a listing skips it (a real worker, a real Redis)."""

from __future__ import annotations

import msgpack
import pytest

from ssmserve.client.errors import DataLoss
from ssmserve.server.sessions.config import SessionConfig
from ssmserve.server.state.store_errors import StoreDataError


@pytest.mark.parametrize(
    "raw",
    [
        SessionConfig().to_bytes() + b"\xc0",  # a config, then extra bytes (msgpack ExtraData)
        SessionConfig().to_bytes()[:-3],  # cut short
        msgpack.packb({"snapshot_every": 1}),  # fields missing
        msgpack.packb([1, 2, 3]),  # not a map
        b"",
    ],
    ids=["extra-data", "cut-short", "fields-missing", "not-a-map", "empty"],
)
def test_a_config_that_does_not_decode_is_store_data_error(raw: bytes) -> None:
    with pytest.raises(StoreDataError, match="stored config does not decode"):
        SessionConfig.from_bytes(raw)


def test_a_listing_skips_a_session_whose_stored_config_does_not_decode(worker) -> None:
    good = worker.client.create_session("demo").session_id
    bad = worker.client.create_session("demo").session_id
    # Parked (snapshotted, out of memory): the worker reads it from Redis from now on.
    worker.call(worker.manager.loader.park(bad, "test"))

    async def corrupt() -> None:
        keys = worker.store.keys(bad)
        config = await worker.store.redis.hget(keys.meta, "config")
        await worker.store.redis.hset(keys.meta, "config", config + b"\xc0")

    worker.call(corrupt())
    listed = {s.session_id for s in worker.client.list_sessions()}
    assert good in listed and bad not in listed
    with pytest.raises(DataLoss, match="stored config does not decode"):
        worker.client.get_session(bad)
