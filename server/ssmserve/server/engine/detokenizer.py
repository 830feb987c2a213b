"""Incremental detokenization: the text each generated token adds, in whole characters.

A token of a byte-level vocabulary may hold part of a character's UTF-8 bytes ("日" is
three bytes, an emoji four, often split over several tokens), and some decoders change a
token's text by its neighbours (a leading space dropped, pieces joined). So a token's
text is not ``decode([token])``. The standard approach (vLLM's
``detokenize_incrementally``, text-generation-inference's ``decode_token``) decodes a
window: the ids since the last point where the text was whole (its *context*, already
sent) plus those after it, and sends what the window's text has past the context's. While
the window's text ends in U+FFFD (what the decoder gives for the bytes of an unfinished
character) the window does not move on, so the next token's bytes are decoded together
with those before them and the character arrives whole.

Beyond vLLM and TGI, the whole characters before an unfinished one are sent at once (a
token holding "a" and the first byte of "é" sends "a"; "é" follows with the token that
ends it). So after every token the text sent so far is ``decode(ids)`` less the U+FFFD at
its end (for byte-level and byte-fallback decoders exactly, which decode by
concatenation; for others as the window's text allows). Nothing whole is ever held back,
so the end of a generation has nothing to flush: what is not sent then is a U+FFFD at the
very end, the bytes of a character the end cut off (or invalid bytes there: the decoder
gives both the same character).

A window that grows past ``MAX_PENDING`` tokens without ending whole (no character is that
long: only invalid bytes do this) moves on anyway, sent as decoded, so a window's decode
stays bounded.

The state depends on the ids alone: a generation resumed after a cut rebuilds it by
feeding the ids it generated before (from the session's log) and gets the same texts.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"
MAX_PENDING = 64  # tokens without a whole character: more than any character's bytes


class IncrementalDetokenizer:
    """The text of each id of a sequence, fed one by one (``add``)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # the window's first id: the text before it is whole and sent
        self._read = 0  # the window's context is ids[_prefix:_read], sent
        self._sent = 0  # characters of the window's text sent past its context

    def add(self, token: int) -> str:
        """The text ``token`` completes: whole characters only, possibly ''."""
        ids = self.ids
        ids.append(token)
        context = self._decode(ids[self._prefix : self._read])
        text = self._decode(ids[self._prefix :])
        whole = not text.endswith(REPLACEMENT) or len(ids) - self._read >= MAX_PENDING
        sendable = text if whole else text.rstrip(REPLACEMENT)
        delta = sendable[len(context) + self._sent :]
        if whole and len(text) > len(context):  # the window ends whole: it moves on
            self._prefix, self._read, self._sent = self._read, len(ids), 0
        else:
            self._sent += len(delta)
        return delta

    def skip(self, tokens: list[int]) -> None:
        """Feed ``tokens`` whose texts were sent already (a resumed generation's)."""
        for token in tokens:
            self.add(token)
