"""A small chat model for the HTTP door's tests and bench: weights, tokenizer, template.

The weights are the token fixture model's shape (``conftest.token_config``) with a
vocabulary of ``VOCAB`` ids; the tokenizer is a byte-level BPE trained here, offline,
with the ``tokenizers`` library (every byte is an id, so any text encodes), plus the
special tokens a chat template writes. ``tokenizer_config.json`` carries a Zephyr-style
``chat_template`` (the shape of many released templates: ``bos_token``, a role check
with ``raise_exception``, ``eos_token`` closing each turn, ``add_generation_prompt``),
and ``generation_config.json`` names ``</s>`` as the end of sequence.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ssmserve.server.engine.config import MambaConfig
from ssmserve.server.engine.demo import random_tensors
from ssmserve.server.engine.loader import save_model
from tests.conftest import token_config

VOCAB = 320
SPECIAL = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
TEXTS = [
    "hello world, how are you today?",
    "the quick brown fox jumps over the lazy dog",
    "state space models carry a fixed-size state from token to token",
    "a Mamba state is a prefix cache: the next turn continues from it",
    "café crème, 日本語, 🙂 and plain ascii",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be system, user or assistant') }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
    )
    tokenizer.train_from_iterator(TEXTS * 4, trainer)
    assert tokenizer.get_vocab_size() <= VOCAB
    return tokenizer


def write_chat_model(
    directory: Path, seed: int = 3, template: bool = True, config: MambaConfig | None = None
) -> Tokenizer:
    """A chat model in ``directory`` (its template left out with ``template`` False);
    ``config``: other dims (its vocabulary is ``VOCAB`` ids)."""
    config = replace(config or token_config(), vocab_size=VOCAB)
    save_model(directory, config, random_tensors(config, seed))
    tokenizer = train_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config: dict[str, object] = {"bos_token": "<s>", "eos_token": "</s>"}
    if template:
        tokenizer_config["chat_template"] = CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    eos = tokenizer.token_to_id("</s>")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return tokenizer
