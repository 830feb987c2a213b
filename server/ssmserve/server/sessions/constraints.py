"""Constrained output: the tokens a JSON schema, a regex or a Lark grammar allows next.

The grammar engine is llguidance (``guidance-ai/llguidance``), the one llama.cpp
(``LLAMA_LLGUIDANCE``), vLLM and SGLang drive: a Rust Earley parser over a lazily built
lexer, that computes a step's mask over the whole vocabulary from the token trie in tens
of microseconds. It is driven as vLLM's ``backend_guidance`` drives it: one
``LLTokenizer`` per model's tokenizer (cached), one ``LLMatcher`` per generation,
``compute_bitmask`` before a draw, ``consume_token`` after it, ``rollback`` on a
retraction.

Exact under replay: a matcher's state is a pure function of the constraint and the
tokens it consumed, so the mask of a step depends on nothing but the request and the
tokens this generation drew before it. A resumed generation rebuilds its matcher by
consuming the tokens the session's log holds (:meth:`TokenMatcher.consume_all`).

The model's tokenizer (``ModelTokenizer.tokenizer``, a ``tokenizers.Tokenizer``) gives
each id's bytes (read by llguidance from its ``tokenizer.json``); the matcher sees the
model's vocabulary (embedding rows past the tokenizer's ids and the tokenizer's special
tokens are never allowed) plus one id of its own past it, ``end``, that stands for "the
output ends here": the model's end-of-sequence ids are allowed exactly where ``end`` is
(the grammar is complete), whichever ids they are.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from ssmserve.server.errors import SsmserveError, clip

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

    from ssmserve.server.engine.tokenizer import ModelTokenizer

ConstraintKind = Literal["json_schema", "regex", "lark_grammar", "json_object"]
KINDS: tuple[ConstraintKind, ...] = ("json_schema", "regex", "lark_grammar", "json_object")
#: Characters of a schema, regex or grammar: bounds the compile work before it starts.
MAX_CONSTRAINT_CHARS = 65_536
#: llguidance's own bound on the compiled grammar (symbols in its productions).
MAX_GRAMMAR_SYMBOLS = 200_000
#: JSON is written compactly (no whitespace between tokens, "," and ":" as separators):
#: one text per document; a schema's "x-guidance" object overrides it.
JSON_DEFAULTS = {"whitespace_flexible": False}
#: Characters of llguidance's message repeated in an error.
MESSAGE_CHARS = 400
#: Model tokenizers whose grammar tokenizers are kept (one per model version served).
CACHED_TOKENIZERS = 16


class BadConstraintError(SsmserveError):
    """A schema, regex or grammar llguidance refuses, one too large, or one given for a
    model without a tokenizer (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class Constraint:
    """What the output must be: ``kind`` and its text (a JSON schema as JSON text, a
    regex in Rust ``regex`` syntax, a Lark grammar as llguidance reads it; ``json_object``
    takes no text: any JSON object)."""

    kind: ConstraintKind
    text: str = ""

    def grammar(self, compact: bool = True) -> str:
        """The llguidance grammar of this constraint (its syntax checked by
        :func:`compile_constraint`), or BadConstraintError. ``compact``: JSON without
        whitespace between tokens (what a constraint writes); else JSON's own whitespace
        allowed (what a monitor reads)."""
        defaults = JSON_DEFAULTS if compact else None
        from llguidance import LLMatcher

        if self.kind not in KINDS:
            raise BadConstraintError(f"constraint kind must be one of {KINDS}, got {self.kind!r}")
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise BadConstraintError(
                f"a {self.kind} of {len(self.text)} characters is over the limit of "
                f"{MAX_CONSTRAINT_CHARS}; give a smaller one"
            )
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=defaults)
        if not self.text:
            raise BadConstraintError(f"the {self.kind} is empty: give one, or no constraint")
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        if self.kind == "lark_grammar":
            return LLMatcher.grammar_from_lark(self.text)
        try:
            schema = json.loads(self.text)
        except ValueError as exc:
            raise BadConstraintError(
                f"the json_schema is not JSON ({clip(exc, MESSAGE_CHARS)}); send the schema "
                f"as JSON text"
            ) from None
        if not isinstance(schema, dict | bool):
            raise BadConstraintError("a json_schema is a JSON object (or true / false)")
        try:
            return LLMatcher.grammar_from_json_schema(self.text, defaults=defaults)
        except ValueError as exc:
            raise BadConstraintError(f"json_schema: {_bounded(str(exc))}") from None


@dataclass(frozen=True)
class GrammarTokenizer:
    """A model's tokenizer as llguidance sees it: ``vocab_size`` model ids, then
    ``end`` (== vocab_size), the id that ends the output."""

    tokenizer: LLTokenizer
    vocab_size: int

    @property
    def end(self) -> int:
        return self.vocab_size


class GrammarTokenizers:
    """One :class:`GrammarTokenizer` per (tokenizer fingerprint, vocabulary size), built
    on first use (a full vocabulary's bytes: tens of milliseconds) and kept."""

    def __init__(self, capacity: int = CACHED_TOKENIZERS) -> None:
        self.capacity = capacity
        self._built: dict[tuple[str, int], GrammarTokenizer] = {}
        self._lock = threading.Lock()  # built off the event loop, maybe two at once

    def get(self, model_tokenizer: ModelTokenizer, vocab_size: int) -> GrammarTokenizer:
        key = (model_tokenizer.fingerprint, vocab_size)
        with self._lock:
            found = self._built.pop(key, None)
            if found is None:
                found = build_grammar_tokenizer(model_tokenizer, vocab_size)
            self._built[key] = found  # the most recently used last
            while len(self._built) > self.capacity:
                del self._built[next(iter(self._built))]
            return found


def build_grammar_tokenizer(model_tokenizer: ModelTokenizer, vocab_size: int) -> GrammarTokenizer:
    """The ``LLTokenizer`` of ``vocab_size`` model ids plus ``end``: each id's bytes as
    llguidance reads them from the ``tokenizer.json``; special tokens and ids past the
    tokenizer have none (never allowed)."""
    from llguidance import LLTokenizer, TokenizerWrapper

    hf = model_tokenizer.tokenizer
    base = LLTokenizer(hf.to_str())
    known = min(base.vocab_size, vocab_size)
    special = [i for i in range(known) if base.is_special_token(i)]
    tokens = [b""] * (vocab_size + 1)
    skipped = set(special)
    for i in range(known):
        if i not in skipped:
            tokens[i] = base.decode_bytes([i])
    wrapper = TokenizerWrapper(_TokenTable(tokens, [*special, vocab_size], hf))
    return GrammarTokenizer(LLTokenizer(wrapper, n_vocab=vocab_size + 1), vocab_size)


class _TokenTable:
    """What ``llguidance.TokenizerWrapper`` reads: each id's bytes, the end id, the
    special ids, and an encoder (llguidance tokenizes a grammar's forced text with it)."""

    def __init__(self, tokens: list[bytes], special: list[int], hf: object) -> None:
        self.tokens = tokens
        self.eos_token_id = len(tokens) - 1
        self.bos_token_id = None
        self.special_token_ids = special
        self._hf = hf

    def __call__(self, text: str) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=False).ids)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint checked against a model's tokenizer: matchers start from it."""

    constraint: Constraint
    grammar: str
    tokenizer: GrammarTokenizer

    def matcher(self) -> TokenMatcher:
        return TokenMatcher(self)


def check_constraint(constraint: Constraint) -> None:
    """BadConstraintError when llguidance refuses ``constraint`` whatever the tokenizer
    (its syntax, a schema it cannot compile, the size limits): what a caller checks
    before it makes anything for a request."""
    from llguidance import LLMatcher

    message = LLMatcher.validate_grammar(constraint.grammar(), None, limits=_limits())
    if message and not message.startswith("WARNING"):
        raise BadConstraintError(f"{constraint.kind}: {_bounded(message)}")


def compile_constraint(
    constraint: Constraint, tokenizer: GrammarTokenizer, compact: bool = True
) -> CompiledConstraint:
    """``constraint`` compiled for ``tokenizer`` (``compact``: as ``Constraint.grammar``),
    or BadConstraintError with llguidance's message (bounded): a regex that does not
    parse, a schema it cannot compile, an unknown rule, a grammar over the size limit."""
    from llguidance import LLMatcher

    grammar = constraint.grammar(compact)
    message = LLMatcher.validate_grammar(grammar, tokenizer.tokenizer, limits=_limits())
    if message and not message.startswith("WARNING"):
        raise BadConstraintError(f"{constraint.kind}: {_bounded(message)}")
    return CompiledConstraint(constraint, grammar, tokenizer)


class TokenMatcher:
    """Where a generation is in its grammar: the ids allowed next, and the ids drawn fed
    in. Its state is a pure function of the ids consumed (and not rolled back)."""

    def __init__(self, compiled: CompiledConstraint) -> None:
        from llguidance import LLMatcher

        self.compiled = compiled
        self.vocab_size = compiled.tokenizer.vocab_size
        self._matcher: LLMatcher = LLMatcher(
            compiled.tokenizer.tokenizer, compiled.grammar, log_level=0, limits=_limits()
        )
        if self._matcher.is_error():  # validated before: a limit hit only while building
            raise BadConstraintError(
                f"{compiled.constraint.kind}: {_bounded(self._matcher.get_error())}"
            )
        self.consumed = 0  # ids consumed and not rolled back

    def allowed(self, end_ids: frozenset[int] = frozenset()) -> np.ndarray:
        """The ids the grammar allows next, (vocab_size,) bool; ``end_ids`` (the model's
        end-of-sequence ids) where the grammar may end here."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size + 1].astype(bool)
        ends = bool(mask[self.vocab_size])
        mask = mask[: self.vocab_size].copy()
        for i in end_ids:
            if 0 <= i < self.vocab_size:
                mask[i] = ends
        return mask

    def accepts(self, token: int) -> bool:
        """Whether ``token`` may come next (consumes nothing); an id outside the
        vocabulary never may."""
        if not 0 <= token < self.vocab_size:
            return False
        return self._matcher.validate_tokens([token]) == 1

    def consume(self, token: int) -> bool:
        """Feed ``token``; False (and nothing consumed) when the grammar refuses it."""
        if not self.accepts(token):
            return False
        ok = self._matcher.consume_token(token)
        assert ok, self._matcher.get_error()
        self.consumed += 1
        return True

    def consume_all(self, tokens: list[int]) -> int:
        """Feed ``tokens`` in order, up to the first one refused: how many were taken."""
        for n, token in enumerate(tokens):
            if not self.consume(token):
                return n
        return len(tokens)

    def ends(self, token: int) -> bool:
        """Feed the end of the output (``token`` the model's end-of-sequence id drawn):
        False when the grammar is not complete here."""
        if not self.accepting:
            return False
        self._matcher.consume_token(self.compiled.tokenizer.end)
        self.consumed += 1
        return True

    def rollback(self, n: int) -> None:
        """Take back the last ``n`` ids consumed."""
        n = min(n, self.consumed)
        if n:
            ok = self._matcher.rollback(n)
            assert ok, self._matcher.get_error()
            self.consumed -= n

    @property
    def accepting(self) -> bool:
        """The output so far is complete (it may end here)."""
        return self._matcher.is_accepting()

    @property
    def complete(self) -> bool:
        """Complete, and nothing more may follow: generation ends here."""
        return self._matcher.is_stopped() and not self._matcher.is_error()


def masked(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """``logits`` with every id ``allowed`` does not hold at -Inf (probability 0): a copy
    of the same dtype (float32 as the model gives them, float64 once adjusted)."""
    out = np.array(logits, copy=True)
    out[~allowed] = -np.inf
    return out


def _limits() -> object:
    from llguidance import LLParserLimits

    return LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS, verbose_errors=False)


def _bounded(message: str) -> str:
    message = message.strip()
    if len(message) <= MESSAGE_CHARS:
        return message
    return message[:MESSAGE_CHARS] + f"... ({len(message)} characters)"
