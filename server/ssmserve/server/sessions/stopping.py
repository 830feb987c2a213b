"""How a generation's text is released, and when its stop rules end it.

A generation ends after ``max_tokens`` tokens (``length``), on a token of
``stop_token_ids`` (``stop``), on one of the model's end-of-sequence ids unless the
request sets ``ignore_eos`` (``eos``), or when its text contains a stop string (``stop``,
with the string). Stop strings are matched on this generation's detokenised text
(``engine.detokenizer``: whole characters), across token boundaries:

- text that may still be the start of a stop string (the longest end of the text not yet
  released that begins one) is held back until it cannot be: a later token either
  completes the match or shows it is none, and then releases it;
- the token whose text completes a match ends the generation; its text is only what
  comes before the match (the stop string and anything after it are not sent);
- the earliest match in the text wins (at equal places, the one listed first);
- the token that ends the generation otherwise (length, a stop id, EOS) releases all the
  held text; an EOS token adds none of its own (its special text is never sent).

The state depends on the generated ids alone: a resumed call rebuilds it by feeding the
ids generated before (:meth:`GeneratedText.skip`, from the session's log) and releases
the same texts an undisturbed call does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from ssmserve.server.engine.detokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class Released:
    """What one token releases: its ``text`` and the stop string it completed ('' none)."""

    text: str
    stop_string: str = ""


class StopStrings:
    """Held-back text and matching for a request's stop strings."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.held = ""
        self._longest = max((len(s) for s in stops), default=0)

    def push(self, text: str) -> Released:
        """``text`` appended to what is held: the part that can no longer begin a stop
        string is released; a completed match releases what precedes it."""
        pending = self.held + text
        found = -1
        matched = ""
        for stop in self.stops:
            at = pending.find(stop)
            if at != -1 and (found == -1 or at < found):
                found, matched = at, stop
        if found != -1:
            self.held = ""
            return Released(pending[:found], matched)
        keep = self._prefix_at_end(pending)
        self.held = pending[len(pending) - keep :] if keep else ""
        return Released(pending[: len(pending) - keep])

    def flush(self) -> str:
        """The held text, released because the generation ended without a match."""
        held, self.held = self.held, ""
        return held

    def _prefix_at_end(self, text: str) -> int:
        """The length of the longest end of ``text`` that some stop string begins with
        (shorter than that stop string: a whole one is a match)."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            end = text[len(text) - n :]
            if any(stop.startswith(end) for stop in self.stops):
                return n
        return 0


class GeneratedText:
    """The text each token of a generation releases (a model with a tokenizer)."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stops: tuple[str, ...],
        eos_ids: Collection[int],
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(decode)
        self.stops = StopStrings(stops)
        self.eos_ids = eos_ids  # ids that add no text (empty when ignore_eos)
        self.stop_string = ""  # the stop string the last token skipped completed

    def add(self, token: int, last: bool) -> Released:
        """What ``token`` releases; ``last``: it ends the generation whatever its text
        (length, a stop id, EOS), so everything held is released with it."""
        text = "" if token in self.eos_ids else self.detokenizer.add(token)
        released = self.stops.push(text)
        if last and not released.stop_string:
            return Released(released.text + self.stops.flush())
        return released

    def skip(self, tokens: list[int]) -> None:
        """Feed ``tokens`` whose texts were released already (a resumed generation's)."""
        for token in tokens:
            self.stop_string = self.add(token, last=False).stop_string

    def flush(self) -> str:
        """The held text, when the generation ends with no token to release it."""
        return self.stops.flush()
