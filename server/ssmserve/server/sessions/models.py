"""ServedModels: the models a worker serves, by name and version.

A model is served under a key, ``NAME`` or ``NAME@VERSION`` (``--model lm@2=DIR``). A
worker may serve several versions of one name. Asking for ``NAME`` (CreateSession,
ImportCheckpoint) means its newest version here; asking for ``NAME@VERSION`` means that
one. A session records the key it was created with (and the weights' fingerprint), so it
stays pinned to that version until it is closed: after a restart or a migration it is
loaded only by a worker that serves that key with the same fingerprint, and a worker that
does not serve it sends the caller to one that does (``loading``).

A token model served with a ``tokenizer.json`` has its tokenizer here too, under the same
key, loaded with it once per version.

Newest is by version, compared in natural order: ``2 < 10``, ``1.9 < 1.10``, and a
version with letters sorts by its text (``2024-06-rc1`` after ``2024-06``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from ssmserve.server.engine.interface import Engine
from ssmserve.server.engine.tokenizer import ModelTokenizer
from ssmserve.server.errors import clip
from ssmserve.server.sessions.errors import UnknownModelError

#: A served key: a name, optionally @ a version; the registry joins keys with commas.
KEY_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}(@[A-Za-z0-9_.-]{1,64})?")


def split_key(key: str) -> tuple[str, str]:
    """``lm@2`` -> (``lm``, ``2``); ``lm`` -> (``lm``, '')."""
    name, _, version = key.partition("@")
    return name, version


def version_order(version: str) -> tuple[tuple[int, int | str], ...]:
    """A sort key: digit runs compare as numbers, the rest as text."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part)
        for part in re.findall(r"\d+|[^\d]+", version)
    )


class ServedModels(Mapping[str, Engine]):
    """The worker's models by key; a read-only mapping plus name resolution."""

    def __init__(self, models: Mapping[str, Engine]) -> None:
        for key in models:
            if not KEY_PATTERN.fullmatch(key):
                raise ValueError(
                    f"model key {key!r}: expected NAME or NAME@VERSION of letters, digits, "
                    f"'.', '_' or '-' (at most 64 each)"
                )
        self._models = dict(models)
        self._tokenizers: dict[str, ModelTokenizer] = {}
        self._eos_ids: dict[str, tuple[int, ...]] = {}

    def __getitem__(self, key: str) -> Engine:
        return self._models[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)

    def versions(self, name: str) -> list[str]:
        """The keys served for ``name``, oldest version first."""
        keys = [k for k in self._models if split_key(k)[0] == name]
        return sorted(keys, key=lambda k: version_order(split_key(k)[1]))

    def resolve(self, requested: str) -> str:
        """The key a request means: itself if served, else the newest version of the
        name; UnknownModelError (NOT_FOUND) when neither is served here."""
        if requested in self._models:
            return requested
        versions = self.versions(requested) if "@" not in requested else []
        if versions:
            return versions[-1]
        raise UnknownModelError(
            f"model {clip(requested)} is not served here (models: {', '.join(sorted(self))})"
        )

    def add(self, key: str, model: Engine) -> None:
        if not KEY_PATTERN.fullmatch(key):
            raise ValueError(f"model key {key!r}: expected NAME or NAME@VERSION")
        self._models[key] = model

    def remove(self, key: str) -> None:
        del self._models[key]
        self._tokenizers.pop(key, None)
        self._eos_ids.pop(key, None)

    def set_eos_ids(self, key: str, ids: tuple[int, ...]) -> None:
        """``key``'s end-of-sequence ids (``engine.tokenizer.read_eos_ids``)."""
        self._eos_ids[key] = ids

    def eos_ids(self, key: str) -> tuple[int, ...]:
        """The ids Generate stops on for ``key`` (unless a request ignores them)."""
        return self._eos_ids.get(key, ())

    def set_tokenizer(self, key: str, tokenizer: ModelTokenizer | None) -> None:
        """``key``'s tokenizer (None: it has none); set before the model is added."""
        if tokenizer is None:
            self._tokenizers.pop(key, None)
        else:
            self._tokenizers[key] = tokenizer

    def tokenizer(self, key: str) -> ModelTokenizer | None:
        """The tokenizer served with ``key``, or None: that model has no text."""
        return self._tokenizers.get(key)

    def newest(self, key: str) -> bool:
        """Whether ``key`` is the newest version of its name here."""
        return self.versions(split_key(key)[0])[-1] == key
