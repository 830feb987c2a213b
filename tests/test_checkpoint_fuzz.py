"""Fuzz the checkpoint decoder: random and mutated blobs raise only CheckpointError.

``Checkpoint.decode`` wraps any unexpected exception into a CheckpointLayoutError as a
safety net, which would make these tests unable to fail; so they drive the strict
decoder underneath it, where a validation gap shows up as a foreign exception.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.errors import CheckpointError
from ssmserve.server.state.checkpoint import MAGIC
from ssmserve.server.state.checkpoint import _decode as decode_strict
from tests.test_checkpoint import header_of, make_checkpoint, reseal

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _decode_or_typed_error(blob: bytes) -> None:
    with contextlib.suppress(CheckpointError):
        decode_strict(blob)


@pytest.fixture(scope="module", params=[1, 2], ids=["format1", "format2"])
def valid_blob(request: pytest.FixtureRequest) -> bytes:
    """A valid blob of each format (the fuzzers below run on both)."""
    model: MambaModel = request.getfixturevalue("signal_model")
    ckpt, inputs = make_checkpoint(model, steps=6, window=4)
    with_output = replace(ckpt, output=model.run(inputs[:6])[0][-1])
    return with_output.encode(format_version=request.param)


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    _decode_or_typed_error(data)
    _decode_or_typed_error(MAGIC + data)


@FUZZ
@given(data=st.data())
def test_mutated_valid_blobs(valid_blob: bytes, data: st.DataObject) -> None:
    blob = bytearray(valid_blob)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        pos = data.draw(st.integers(0, max(0, len(blob) - 1)))
        if op == "flip" and blob:
            blob[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut":
            del blob[pos:]
        elif op == "insert":
            blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif blob:
            del blob[pos]
    _decode_or_typed_error(bytes(blob))


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=12,
)


@FUZZ
@given(data=st.data())
def test_resealed_headers_with_random_fields(valid_blob: bytes, data: st.DataObject) -> None:
    """Valid checksum, hostile header: exercises every schema check, not just the digest."""
    header = header_of(valid_blob)
    paths = [
        ("step",),
        ("session_id",),
        ("model", "id"),
        ("model", "fingerprint"),
        ("arrays",),
        ("history",),
        ("meta",),
        ("meta", "tags"),
        ("meta", "created_at"),
        ("meta", "label"),
        ("arrays", 0),
        ("arrays", 0, 1),
        ("arrays", 0, 2),
        ("arrays", 0, 3),
        ("arrays", 0, 4),
        ("history", 0),
        ("history", 2),
        ("history", 3),
        ("output",),
        ("output", 1),
        ("output", 2),
        ("state",),
        ("state", "layers"),
        ("state", "conv"),
        ("state", "ssm"),
        ("state", "conv", 0),
        ("state", "ssm", 1),
        ("state", "array"),
        ("state", "array", 0),
        ("state", "array", 1),
        ("state", "array", 2),
        ("state", "array", 3),
    ]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        target = header
        try:
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = data.draw(_msgpack_values)
        except (TypeError, KeyError, IndexError):
            continue  # an earlier mutation removed this path
    try:
        blob = reseal(valid_blob, header)
    except (ValueError, OverflowError, TypeError, msgpack.PackException):
        return  # hypothesis made a value msgpack cannot pack; nothing to decode
    _decode_or_typed_error(blob)


def test_every_truncation_and_every_bit_flip_of_the_prefix_and_header_is_refused(
    valid_blob: bytes,
) -> None:
    """Exhaustive where it is cheap: each cut length, and each bit of the prefix and header
    flipped (the payload's bits: ``test_checkpoint.py``), raises a CheckpointError; none
    decodes."""
    for cut in range(len(valid_blob)):
        with pytest.raises(CheckpointError):
            decode_strict(valid_blob[:cut])
    hlen = int.from_bytes(valid_blob[12:16], "little")
    for pos in range(24 + hlen):
        for bit in range(8):
            flipped = bytearray(valid_blob)
            flipped[pos] ^= 1 << bit
            with pytest.raises(CheckpointError):
                decode_strict(bytes(flipped))


@pytest.mark.slow
@settings(
    max_examples=2500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_soak_mutated_and_resealed(valid_blob: bytes, data: st.DataObject) -> None:
    """The two mutation fuzzers above, 2,500 examples each way (slow marker; ~15 s per
    format in CI)."""
    test_mutated_valid_blobs.hypothesis.inner_test(valid_blob, data)
    test_resealed_headers_with_random_fields.hypothesis.inner_test(valid_blob, data)
