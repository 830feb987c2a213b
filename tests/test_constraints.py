"""Constrained output and the text monitor, below the server: llguidance's masks over a
real byte-level BPE tokenizer, a matcher rebuilt from a token history, the monitor's
retraction arithmetic and its seeds (``sessions.constraints``, ``sessions.text_monitor``,
``sessions.guided_output``). Through a real worker: ``tests/test_constraints_served.py``.
"""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ssmserve.server.engine.tokenizer import ModelTokenizer
from ssmserve.server.sessions.constraints import (
    MAX_CONSTRAINT_CHARS,
    BadConstraintError,
    Constraint,
    GrammarTokenizers,
    compile_constraint,
    masked,
)
from ssmserve.server.sessions.guided_output import OutputRules, Verdict, prepare_guide
from ssmserve.server.sessions.sampling import SamplingParams, draw
from ssmserve.server.sessions.text_monitor import (
    MonitorRejectedError,
    TextMonitor,
    attempt_seed,
)

VOCAB = 300  # the model's embedding rows: more than the tokenizer's ids
EOS = 0  # the tokenizer's "<eos>" special token, the model's end-of-sequence id
SENTENCES = ['{"a": 12, "name": "bob", "ok": true}', "hello world abc", '["x", "y", 3.5]']
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["a", "ok"],
    "additionalProperties": False,
}


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE (every byte an id, then merges), "<eos>" its id 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
    )
    tokenizer.train_from_iterator(SENTENCES, trainer)
    assert tokenizer.token_to_id("<eos>") == EOS and tokenizer.get_vocab_size() < VOCAB
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer()


@pytest.fixture(scope="module")
def grammar_tokenizer(tokenizer):
    return GrammarTokenizers().get(ModelTokenizer(tokenizer, "fingerprint"), VOCAB)


def random_logits(rng: np.random.Generator) -> np.ndarray:
    return rng.normal(0.0, 3.0, VOCAB).astype(np.float32)


def generate(compiled, seed: int, n: int = 200, temperature: float = 1.0) -> list[int]:
    """Masked seeded draws from random logits until the grammar is complete or EOS."""
    matcher, rng = compiled.matcher(), np.random.default_rng(seed)
    params, out = SamplingParams(temperature=temperature, seed=seed), []
    for step in range(n):
        d = draw(params, (seed, step), masked(random_logits(rng), matcher.allowed({EOS})))
        out.append(d.token)
        if d.token == EOS:
            assert matcher.ends(d.token)
            break
        assert matcher.consume(d.token)
        if matcher.complete:
            break
    return out


def text(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode([i for i in ids if i != EOS])


def test_json_schema_output_parses_and_validates(tokenizer, grammar_tokenizer):
    compiled = compile_constraint(Constraint("json_schema", json.dumps(SCHEMA)), grammar_tokenizer)
    for seed in range(12):
        doc = json.loads(text(tokenizer, generate(compiled, seed)))
        assert set(doc) == {"a", "ok"}
        assert isinstance(doc["a"], int) and isinstance(doc["ok"], bool)
    anything = compile_constraint(Constraint("json_object"), grammar_tokenizer)
    assert isinstance(json.loads(text(tokenizer, generate(anything, 3))), dict)


def test_regex_and_grammar_output_match(tokenizer, grammar_tokenizer):
    regex = compile_constraint(Constraint("regex", r"(ab|x)+c"), grammar_tokenizer)
    lark = compile_constraint(
        Constraint("lark_grammar", 'start: "[" NUM ("," NUM)* "]"\nNUM: /[0-9]{1,3}/'),
        grammar_tokenizer,
    )
    for seed in range(8):
        assert re.fullmatch(r"(ab|x)+c", text(tokenizer, generate(regex, seed)))
        assert re.fullmatch(r"\[[0-9]{1,3}(,[0-9]{1,3})*\]", text(tokenizer, generate(lark, seed)))


def test_eos_and_ids_past_the_tokenizer_are_allowed_only_where_the_grammar_ends(
    tokenizer, grammar_tokenizer
):
    m = compile_constraint(Constraint("regex", "(ab)+"), grammar_tokenizer).matcher()
    assert not m.allowed({EOS})[EOS]
    assert not m.allowed()[tokenizer.get_vocab_size() :].any()  # rows with no text
    assert m.consume_all(tokenizer.encode("abab").ids) == len(tokenizer.encode("abab").ids)
    allowed = m.allowed({EOS, 5})
    assert allowed[EOS] and allowed[5]  # both model EOS ids, where it may end
    assert not m.consume(tokenizer.token_to_id("c"))  # refused, nothing consumed
    assert m.accepting and not m.complete
    assert not m.accepts(VOCAB + 3) and not m.accepts(-1)


def test_a_matcher_rebuilt_from_the_tokens_gives_the_same_masks(grammar_tokenizer):
    """A resumed call's matcher: the masks after any prefix are those of the matcher
    that drew them, and a rollback gives the masks before."""
    compiled = compile_constraint(Constraint("json_schema", json.dumps(SCHEMA)), grammar_tokenizer)
    tokens = generate(compiled, 5)
    live, masks = compiled.matcher(), []
    for t in tokens[:-1]:
        masks.append(live.allowed({EOS}))
        assert live.consume(t)
    for cut in (0, 1, 4, len(tokens) - 2):
        rebuilt = compiled.matcher()
        assert rebuilt.consume_all(tokens[:cut]) == cut
        np.testing.assert_array_equal(rebuilt.allowed({EOS}), masks[cut])
    live.rollback(3)
    np.testing.assert_array_equal(live.allowed({EOS}), masks[len(tokens) - 4])


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint("regex", "a(b"), "unclosed group"),
        (Constraint("json_schema", "{bad"), "not JSON"),
        (Constraint("json_schema", '{"type": "frob"}'), "frob"),
        (Constraint("json_schema", "[1]"), "a JSON object"),
        (Constraint("lark_grammar", "start: foo"), "unknown name"),
        (Constraint("regex", ""), "empty"),
        (Constraint("regex", "a" * (MAX_CONSTRAINT_CHARS + 1)), "over the limit"),
        (Constraint("sql", "x"), "kind must be"),  # type: ignore[arg-type]
    ],
)
def test_bad_constraints_are_refused_with_llguidance_message(
    grammar_tokenizer, constraint, message
):
    with pytest.raises(BadConstraintError, match=message) as caught:
        compile_constraint(constraint, grammar_tokenizer)
    assert len(str(caught.value)) < 600


def test_attempt_seeds_are_distinct_and_attempt_zero_is_the_seed():
    assert attempt_seed(77, 0) == 77
    seeds = {attempt_seed(s, a) for s in (0, 77, 2**64 - 1) for a in range(1, 50)}
    assert len(seeds) == 3 * 49 and attempt_seed(77, 3) == attempt_seed(77, 3)


def guide(tokenizer, rules, temperature=1.0):
    return asyncio.run(
        prepare_guide(
            rules, ModelTokenizer(tokenizer, "fingerprint"), VOCAB, "m", temperature,
            GrammarTokenizers(),
        )
    )  # fmt: skip


def test_the_monitor_rejects_what_cannot_become_a_match_and_counts_its_retries(tokenizer):
    ids = tokenizer.encode("abab").ids
    g = guide(tokenizer, OutputRules(monitor=TextMonitor(Constraint("regex", "(ab)+c"), 2, 2)))
    assert g.matcher is None and g.seed(9) == 9
    assert [g.after(t, frozenset({EOS})) for t in ids] == [Verdict.GOES_ON] * len(ids)
    assert g.after(EOS, frozenset({EOS})) is Verdict.REJECTED  # not complete: no end here
    assert g.retract() == 2 and g.tokens == ids[:-1] and g.retries == 1
    assert g.seed(9) == attempt_seed(9, 1)
    assert g.after(tokenizer.token_to_id("x"), frozenset({EOS})) is Verdict.REJECTED
    assert g.retract() == 2 and g.tokens == ids[:-2]
    assert g.after(tokenizer.token_to_id("b"), frozenset()) is Verdict.REJECTED
    with pytest.raises(MonitorRejectedError, match="3 times, over max_retries 2"):
        g.retract()
    done = guide(tokenizer, OutputRules(monitor=TextMonitor(Constraint("regex", "ab"))))
    assert [done.after(t, frozenset()) for t in tokenizer.encode("ab").ids][-1] is Verdict.COMPLETE


def test_a_rebuilt_guide_is_where_the_first_was(tokenizer):
    rules = OutputRules(
        constraint=Constraint("json_schema", json.dumps(SCHEMA)),
        monitor=TextMonitor(Constraint("regex", r'\{"a":1.*')),
        monitor_retries=4,
    )
    ids = tokenizer.encode('{"a":12').ids
    rebuilt, live = guide(tokenizer, rules), guide(tokenizer, rules)
    assert rebuilt.rebuild(ids, frozenset({EOS})) and rebuilt.retries == 4
    assert [live.after(t, frozenset({EOS})) for t in ids] == [Verdict.GOES_ON] * len(ids)
    zeros = np.zeros(VOCAB, np.float32)
    np.testing.assert_array_equal(
        rebuilt.logits(zeros, frozenset({EOS})), live.logits(zeros, frozenset({EOS}))
    )
    assert rebuilt.seed(1) == live.seed(1) == attempt_seed(1, 4)
    assert not guide(tokenizer, rules).rebuild(tokenizer.encode('{"a":2').ids, frozenset())


def test_rules_a_model_without_tokenizer_or_a_greedy_monitor_cannot_take(tokenizer):
    rules = OutputRules(constraint=Constraint("regex", "a+"))
    with pytest.raises(BadConstraintError, match=r"no tokenizer\.json"):
        asyncio.run(prepare_guide(rules, None, VOCAB, "m", 1.0, GrammarTokenizers()))
    greedy = OutputRules(monitor=TextMonitor(Constraint("regex", "a+")))
    with pytest.raises(BadConstraintError, match="temperature > 0"):
        guide(tokenizer, greedy, temperature=0.0)
    for monitor, message in [
        (TextMonitor(Constraint("lark_grammar", "start: a")), "regex or a json_schema"),
        (TextMonitor(Constraint("regex", "a"), rollback_tokens=0), "rollback_tokens"),
        (TextMonitor(Constraint("regex", "a"), max_retries=65), "max_retries"),
    ]:
        with pytest.raises(BadConstraintError, match=message):
            guide(tokenizer, OutputRules(monitor=monitor))


def test_a_json_monitor_reads_json_whitespace_a_json_constraint_writes_none(tokenizer):
    spaced = tokenizer.encode('{"a": 12, "ok": true}').ids
    rules = OutputRules(monitor=TextMonitor(Constraint("json_schema", json.dumps(SCHEMA))))
    g = guide(tokenizer, rules)
    verdicts = [g.after(t, frozenset({EOS})) for t in spaced]
    assert verdicts[-1] is Verdict.COMPLETE and set(verdicts[:-1]) == {Verdict.GOES_ON}
    unfinished = guide(tokenizer, rules)
    assert unfinished.rebuild(spaced[:-1], frozenset({EOS}))
    assert unfinished.after(EOS, frozenset({EOS})) is Verdict.REJECTED  # not complete yet
    constrained = guide(tokenizer, OutputRules(Constraint("json_schema", json.dumps(SCHEMA))))
    assert not constrained.rebuild(spaced, frozenset({EOS}))  # compact: no space allowed
    assert constrained.matcher is not None
