"""Checkpoints that prove their origin: an HMAC over the exported bytes.

A checkpoint's checksum proves it was not damaged, not who made it. With a server key
(``--checkpoint-key FILE``, shared by the workers that should trust each other's
exports), every export ends with a trailer: ``SIGNATURE_MAGIC`` + HMAC-SHA256(key, the
checkpoint's bytes). An import strips a trailer and checks it; with
``--require-signed-checkpoints`` a checkpoint without a valid one is refused, so only
what these workers exported can come back in. The checkpoint format itself is unchanged:
a signed export is the same bytes plus 40.
"""

from __future__ import annotations

import hashlib
import hmac

from ssmserve.server.errors import CheckpointError

SIGNATURE_MAGIC = b"\x89SSMSIG\n"
TRAILER_BYTES = len(SIGNATURE_MAGIC) + hashlib.sha256().digest_size


class CheckpointSignatureError(CheckpointError):
    """A checkpoint whose signature does not verify, or none where one is required."""


def sign(blob: bytes, key: bytes) -> bytes:
    """``blob`` with its signature trailer."""
    return blob + SIGNATURE_MAGIC + hmac.digest(key, blob, "sha256")


def unwrap(
    blob: bytes | memoryview, key: bytes | None, required: bool
) -> tuple[bytes | memoryview, bool]:
    """The checkpoint's bytes without a trailer (a view of ``blob``'s when it is a
    memoryview), and whether a signature was verified.

    A trailer is checked whenever this worker has a key; a worker without one cannot
    tell a signed checkpoint from a forged one, so it strips the trailer and calls the
    checkpoint unverified.
    """
    signed = len(blob) > TRAILER_BYTES and (
        blob[-TRAILER_BYTES : -TRAILER_BYTES + len(SIGNATURE_MAGIC)] == SIGNATURE_MAGIC
    )
    body = blob[:-TRAILER_BYTES] if signed else blob
    if signed and key is not None:
        if not hmac.compare_digest(
            blob[-hashlib.sha256().digest_size :], hmac.digest(key, body, "sha256")
        ):
            raise CheckpointSignatureError(
                "the checkpoint's signature does not verify: it was changed, or signed "
                "with another key than this worker's"
            )
        return body, True
    if required:
        raise CheckpointSignatureError(
            "this worker accepts only checkpoints signed with its key (exported by a worker "
            "sharing --checkpoint-key); this one is not signed"
            if not signed
            else "this worker has no key to check the checkpoint's signature with"
        )
    return body, False
