"""A token model's tokenizer: the Hugging Face ``tokenizer.json`` beside its weights.

A model directory that holds ``tokenizer.json`` (as transformers saves it, and as the
released Mamba checkpoints ship it) has text in and out: Generate encodes a prompt text
with it and decodes the generated ids (``detokenizer``). The file is read by Hugging
Face's ``tokenizers`` library, the reference implementation of the format (pre-tokenizers,
BPE / Unigram / WordPiece models, post-processors, decoders); nothing here interprets it.

A GGUF file (``--model NAME=FILE.gguf``) takes the ``tokenizer.json`` beside it when there
is one, and otherwise the tokenizer stored in its metadata, rebuilt as the
``tokenizers.Tokenizer`` it was converted from (``gguf_tokenizer``).

Loading is strict like the weights': a file the library cannot read, or one whose ids do
not fit the model's embedding rows, is a :class:`~ssmserve.server.errors.ModelFormatError`
that names it. The library is imported only when a model has a tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ssmserve.server.errors import ModelFormatError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"


@dataclass(frozen=True)
class ModelTokenizer:
    """One model version's tokenizer; ``fingerprint``: sha256 of its ``tokenizer.json``."""

    tokenizer: Tokenizer
    fingerprint: str

    def encode(self, text: str) -> np.ndarray:
        """The ids of ``text`` (int64), with the special tokens the file's post-processor
        adds (what the model was trained to see)."""
        return np.asarray(self.tokenizer.encode(text).ids, np.int64)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens left out; bytes that are no whole UTF-8
        character decode as U+FFFD."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(directory: str | Path, vocab_size: int) -> ModelTokenizer | None:
    """The tokenizer of the model in ``directory`` (``vocab_size`` embedding rows), or
    None when it has none: the directory's ``tokenizer.json``; for a GGUF file, the
    ``tokenizer.json`` beside it, else the tokenizer inside it (``gguf_tokenizer``, its
    fingerprint the sha256 of the ``tokenizer.json`` it amounts to)."""
    source = Path(directory)
    gguf = _is_gguf(source)
    path = (source.parent if gguf else source) / TOKENIZER_FILE
    if gguf and not path.is_file():
        from ssmserve.server.engine.gguf_tokenizer import gguf_tokenizer

        built = gguf_tokenizer(source)
        if built is None:
            return None
        return _checked(ModelTokenizer(*built), f"{source}'s tokenizer", vocab_size)
    if not path.is_file():
        return None
    raw = path.read_bytes()
    from tokenizers import Tokenizer  # only for models that have one

    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # not UTF-8, or what the library raises (plain Exception)
        raise ModelFormatError(
            f"{path} cannot be read as a Hugging Face tokenizer.json ({str(exc)[:200]}); "
            f"replace it with the model's own, or remove it to serve the model without text"
        ) from None
    return _checked(ModelTokenizer(tokenizer, hashlib.sha256(raw).hexdigest()), path, vocab_size)


def read_eos_ids(source: str | Path, vocab_size: int) -> tuple[int, ...]:
    """The end-of-sequence ids of the token model at ``source`` (sorted, distinct), where
    Generate stops by default: ``eos_token_id`` (an id or a list) of the directory's
    ``generation_config.json``, else of its ``config.json``; for a GGUF file its
    ``tokenizer.ggml.eos_token_id``. () when none is given. An id that is no int or is
    outside the vocabulary refuses the model (``ModelFormatError``)."""
    source = Path(source)
    if _is_gguf(source):
        from ssmserve.server.engine.gguf_model import open_gguf

        field = open_gguf(source).fields.get("tokenizer.ggml.eos_token_id")
        found = None if field is None else field.contents()
        return _eos_checked(found, f"{source.name}'s tokenizer.ggml.eos_token_id", vocab_size)
    for name in (GENERATION_CONFIG_FILE, "config.json"):
        path = source / name
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text("utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelFormatError(f"{path} cannot be read as JSON ({str(exc)[:200]})") from None
        found = config.get("eos_token_id") if isinstance(config, dict) else None
        if found is not None:
            return _eos_checked(found, f"{path}'s eos_token_id", vocab_size)
    return ()


def _eos_checked(found: object, what: str, vocab_size: int) -> tuple[int, ...]:
    if found is None:
        return ()
    ids = found if isinstance(found, list) else [found]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise ModelFormatError(
                f"{what} is {str(found)[:100]}: expected token ids in [0, {vocab_size}); fix "
                f"or remove it"
            )
    return tuple(sorted(set(ids)))


def _checked(tokenizer: ModelTokenizer, what: object, vocab_size: int) -> ModelTokenizer:
    """``tokenizer``, unless it has an id past the model's embedding rows (refused)."""
    ids = tokenizer.tokenizer.get_vocab(with_added_tokens=True).values()
    top = max(ids, default=-1)
    if top >= vocab_size:
        raise ModelFormatError(
            f"{what} has token id {top}, outside the model's {vocab_size} embedding rows: "
            f"it is not this model's tokenizer"
        )
    return tokenizer


def _is_gguf(path: Path) -> bool:
    from ssmserve.server.engine.loader import is_gguf

    return is_gguf(path)
