"""The tokenizer inside a GGUF file, as a Hugging Face ``tokenizers.Tokenizer``.

A GGUF served with no ``tokenizer.json`` beside it (``tokenizer.load_tokenizer``) has
text in and out through the tokenizer that ``convert_hf_to_gguf.py`` stored in its
metadata: ``tokenizer.ggml.model`` ``gpt2`` (byte-level BPE, what the Mamba checkpoints
use), its ``tokens``, ``token_type``, ``merges``, ``pre``, the BOS / EOS ids and the
``add_bos_token`` / ``add_eos_token`` flags. They are put back together into the
tokenizer the file was converted from, and ``tokenizers`` (the reference implementation)
runs it, as it runs a ``tokenizer.json``:

* the BPE model: every token but the converter's padding (``[PAD{i}]`` at id ``i``, or
  type UNUSED: ids the Hugging Face tokenizer did not have), the merges in order, no
  unknown token (byte-level needs none);
* CONTROL (and UNKNOWN) tokens are special added tokens (skipped when decoding),
  USER_DEFINED ones plain added tokens (GPT-NeoX's runs of spaces), matched in the raw
  text before the rest, as the Hugging Face tokenizer and llama.cpp both do;
* the pre-tokenizer and decoder: byte-level with GPT-2's split regex, no prefix space.
  ``tokenizer.ggml.pre`` says which tokenizer it was: ``gpt-2`` (GPT-2's: no normalizer),
  ``mpt`` or ``olmo`` (the names llama.cpp gives GPT-NeoX-20b's tokenizer, the one the
  released Mamba checkpoints ship, and its OLMo variant: NFC normalisation first, as their
  ``tokenizer.json`` and transformers' ``GPTNeoXTokenizer`` do; llama.cpp itself skips
  it). Any other name is refused: its Hugging Face tokenizer may normalise, split or add
  tokens otherwise;
* a BOS (EOS) token before (after) the text where ``add_bos_token`` (``add_eos_token``)
  says so.

``tests/test_gguf.py`` checks it against the ``tokenizer.json`` the fixtures' GGUFs were
converted from (ids and decoded text on ASCII, Unicode, whitespace runs, digits, code and
special-token text). Built this way from llama.cpp's own vocab files of GPT-2
(``models/ggml-vocab-gpt-2.gguf``) and of GPT-NeoX-20b (``ggml-vocab-mpt.gguf``), it gives
the ids their ``.out`` files record from the Hugging Face tokenizers on all 46 texts of
their ``.inp`` files (checked by hand; those files are llama.cpp's, not committed here).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ssmserve.server.errors import ModelFormatError, clip

if TYPE_CHECKING:
    from tokenizers import Tokenizer

#: ``tokenizer.ggml.pre`` values read here -> whether their tokenizer normalises to NFC.
PRE_TOKENIZERS = {"gpt-2": False, "mpt": True, "olmo": True}

# llama.cpp's token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def gguf_tokenizer(path: str | Path) -> tuple[Tokenizer, str] | None:
    """The tokenizer stored in the GGUF file ``path`` and its fingerprint (sha256 of its
    ``tokenizer.json`` form), or None when the file holds no tokenizer. A tokenizer that
    cannot be rebuilt exactly is a :class:`ModelFormatError` naming what and why."""
    from ssmserve.server.engine.gguf_model import open_gguf

    path = Path(path)
    fields = open_gguf(path).fields

    def value(key: str) -> Any:
        field = fields.get(key)
        return None if field is None else field.contents()

    model = value("tokenizer.ggml.model")
    if model is None:
        return None
    where = f"{path.name}: its tokenizer"
    remedy = "put the model's tokenizer.json beside the GGUF to serve it with text"
    if model != "gpt2":
        raise ModelFormatError(
            f"{where} is tokenizer.ggml.model {clip(model)}; only 'gpt2' (byte-level "
            f"BPE) is rebuilt here: {remedy}"
        )
    pre = value("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise ModelFormatError(
            f"{where} has pre-tokenizer {clip(pre)}; rebuilt here: "
            f"{', '.join(map(repr, PRE_TOKENIZERS))}: {remedy}"
        )
    tokens, types, merges = (
        value(f"tokenizer.ggml.{key}") for key in ("tokens", "token_type", "merges")
    )
    if not isinstance(tokens, list) or not isinstance(types, list) or len(tokens) != len(types):
        raise ModelFormatError(f"{where}: tokenizer.ggml.tokens / token_type are missing or differ")
    if not isinstance(merges, list):
        raise ModelFormatError(f"{where}: tokenizer.ggml.merges is missing")
    tokenizer = _build(where, tokens, types, merges, PRE_TOKENIZERS[pre], value)
    text = tokenizer.to_str()
    return tokenizer, hashlib.sha256(text.encode()).hexdigest()


def _build(
    where: str,
    tokens: list[str],
    types: list[int],
    merges: list[str],
    nfc: bool,
    value: Any,
) -> Tokenizer:
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.processors import TemplateProcessing

    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == _UNUSED or token == f"[PAD{i}]":  # the converter's padding
            continue
        if kind == _BYTE:
            raise ModelFormatError(f"{where}: token {i} is a BYTE token, which BPE has not")
        if token in vocab:
            raise ModelFormatError(
                f"{where}: token {clip(token)} is stored twice (ids {vocab[token]}, {i})"
            )
        vocab[token] = i
        if kind in (_CONTROL, _UNKNOWN):
            added.append(AddedToken(token, special=True, normalized=False))
        elif kind == _USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    pairs = []
    for merge in merges:
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2 or not all(parts):
            raise ModelFormatError(f"{where}: merge {clip(merge)} is not two tokens")
        pairs.append((parts[0], parts[1]))
    try:
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    except Exception as exc:  # what the library raises (plain Exception)
        raise ModelFormatError(f"{where} cannot be built: {clip(str(exc))}") from None
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([a for a in added if a.special])
    tokenizer.add_tokens([a for a in added if not a.special])
    ends = []
    for end in ("bos", "eos"):
        if value(f"tokenizer.ggml.add_{end}_token"):
            tid = value(f"tokenizer.ggml.{end}_token_id")
            if not isinstance(tid, int) or not 0 <= tid < len(tokens) or tid not in vocab.values():
                raise ModelFormatError(
                    f"{where}: add_{end}_token is set but {end}_token_id {clip(tid)} is "
                    f"not one of its tokens"
                )
            ends.append((end, tokens[tid], tid))
    if ends:
        bos = [t for e, t, _ in ends if e == "bos"]
        eos = [t for e, t, _ in ends if e == "eos"]
        tokenizer.post_processor = TemplateProcessing(
            single=" ".join([*bos, "$A", *eos]),
            pair=" ".join([*bos, "$A", *eos, *bos, "$B", *eos]),
            special_tokens=sorted({(t, tid) for _, t, tid in ends}, key=lambda x: x[1]),
        )
    return tokenizer
