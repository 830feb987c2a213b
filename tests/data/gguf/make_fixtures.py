#!/usr/bin/env python3
"""Regenerate the GGUF fixtures: two tiny random-weight Hugging Face language models and
the GGUF files that llama.cpp's own converter (``convert_hf_to_gguf.py``) writes of them.

What it writes, under ``tests/data/gguf/``:

* ``mamba1/``: a ``MambaForCausalLM`` directory (d 32, e 64, n 8, conv 4, Δ rank 2, two
  layers, vocab 384, untied head), written by ``loader.save_model`` (F32) with
  ``demo.random_tensors`` weights, plus ``tokenizer.json`` and ``tokenizer_config.json``;
* ``mamba2/``: a ``Mamba2ForCausalLM`` directory (d 32, e 64, 4 heads of 16, 2 groups,
  n 8, conv 4, two layers, vocab 384, tied head), the same way; its tokenizer adds a BOS;
* ``{mamba1,mamba2}-{f32,f16,bf16,q8_0}.gguf``: the converter's output for each
  ``--outtype``. They sit outside the directories on purpose: beside a GGUF with no
  ``tokenizer.json`` the worker builds the tokenizer from the GGUF's own metadata.

The tokenizer is a byte-level BPE (GPT-2 / GPT-NeoX style: ``ByteLevel`` pre-tokenizer
and decoder, ``<|endoftext|>`` id 0 and ``<|padding|>`` id 1) trained here by
``tokenizers`` on the small corpus below to 360 tokens; the models have 384 embedding
rows, so the converter pads the GGUF's token list with 24 unused ``[PADn]`` tokens, as it
does for the released checkpoints.

The converter names a BPE tokenizer's pre-tokenizer by hashing its encoding of a fixed
text and looking the hash up among known models' tokenizers; a tokenizer trained here has
no known hash, and the converter refuses it (``NotImplementedError: BPE pre-tokenizer was
not recognized``), asking for the model to be added to its table. This script adds it
the way that table would: it runs the converter unchanged except that an unrecognised
hash is named ``gpt-2`` (GPT-2's split regex, which llama.cpp also uses for the GPT-NeoX
tokenizer of the released Mamba checkpoints, named ``mpt`` or ``olmo``). That is the only
change; every tensor and every other key is the converter's own.

Usage (from the repository root; needs torch and transformers, as the converter does):

    .venv/bin/pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    .venv/bin/python tests/data/gguf/make_fixtures.py \\
        /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp

The committed files came from llama.cpp as vendored in llama-cpp-python 0.3.36 (its
``gguf-py`` 0.19.0), torch 2.13.0+cpu, transformers 5.24.0, tokenizers 0.23.3.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "server"))
sys.path.insert(0, str(ROOT))

from ssmserve.server.engine.config import Architecture, MambaConfig  # noqa: E402
from ssmserve.server.engine.demo import random_tensors  # noqa: E402
from ssmserve.server.engine.loader import save_model  # noqa: E402

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
VOCAB_ROWS = 384
TOKENIZER_SIZE = 360
SPECIAL = ("<|endoftext|>", "<|padding|>")

CORPUS = """\
The quick brown fox jumps over the lazy dog. A state space model keeps a fixed-size state
and reads one token at a time; its cost per token does not grow with the context.
Mamba selects what to remember: the step size, B and C depend on the input.
Mamba-2 ties the state matrix to a scalar per head, and computes the scan in chunks.
def step(state, token):
    return state * decay + token  # one recurrent step
for i in range(10): print(i, i ** 2, f"{i:03d}")
if (x >= 0 && y != 1) { return x + y; } else { return -1; }
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 1e-5 0x1F 1,000,000.
Café, naïve, façade, résumé, Zürich, São Paulo, Kraków, İstanbul, Ærøskøbing.
Ελληνικά, русский язык, 中文字符, 日本語のテキスト, 한국어, עברית, العربية, हिन्दी.
Emoji: 🚀 🦙 ✅ 😁 👍🏽 and a family 👨‍👩‍👧 in one grapheme.
    indented code line
\tTabbed\tcolumns\there
Multiple   spaces   between   words, and trailing spaces\x20\x20\x20
Quotes: 'single', "double", `back`, «guillemets», “curly”.
I've, you're, he's, we'll, they'd, I'm, don't, can't, won't.
"""


def corpus() -> list[str]:
    lines = CORPUS.splitlines(keepends=True)
    return lines * 20 + ["".join(lines)] * 5


def train_tokenizer(add_bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_SIZE,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{SPECIAL[0]} $A",
            pair=f"{SPECIAL[0]} $A {SPECIAL[0]} $B",
            special_tokens=[(SPECIAL[0], tok.token_to_id(SPECIAL[0]))],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    assert tok.get_vocab_size() == TOKENIZER_SIZE
    return tok


def tokenizer_config(add_bos: bool) -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL[0],
        "eos_token": SPECIAL[0],
        "unk_token": SPECIAL[0],
        "pad_token": SPECIAL[1],
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "model_max_length": 2048,
    }


def mamba1_config() -> MambaConfig:
    return MambaConfig(
        architecture=Architecture.LM,
        hidden_size=32,
        state_size=8,
        num_hidden_layers=2,
        intermediate_size=64,
        conv_kernel=4,
        time_step_rank=math.ceil(32 / 16),
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        vocab_size=VOCAB_ROWS,
        tie_word_embeddings=False,
    )


def mamba2_config() -> MambaConfig:
    return MambaConfig(
        architecture=Architecture.MAMBA2_LM,
        hidden_size=32,
        state_size=8,
        num_hidden_layers=2,
        intermediate_size=64,
        conv_kernel=4,
        time_step_rank=0,
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        vocab_size=VOCAB_ROWS,
        tie_word_embeddings=True,
        num_heads=4,
        head_dim=16,
        n_groups=2,
    )


MODELS = {"mamba1": (mamba1_config, 21, False), "mamba2": (mamba2_config, 22, True)}

# Runs in a fresh interpreter: the converter puts its own gguf-py first on sys.path.
RUNNER = """
import sys
sys.path.insert(0, sys.argv[1])
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
import convert_hf_to_gguf
from conversion.base import TextModel

known = TextModel.get_vocab_base_pre

def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:  # the fixture's tokenizer: GPT-2's regex
        return "gpt-2"

TextModel.get_vocab_base_pre = get_vocab_base_pre
convert_hf_to_gguf.main()
"""


def write_model(name: str, converter: Path) -> None:
    make_config, seed, add_bos = MODELS[name]
    config = make_config()
    directory = HERE / name
    shutil.rmtree(directory, ignore_errors=True)
    save_model(directory, config, random_tensors(config, seed))
    tok = train_tokenizer(add_bos)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(add_bos), indent=2) + "\n", encoding="utf-8"
    )
    for outtype in OUTTYPES:
        out = HERE / f"{name}-{outtype}.gguf"
        args = [str(directory), "--outtype", outtype, "--outfile", str(out)]
        subprocess.run([sys.executable, "-c", RUNNER, str(converter), *args], check=True)
        print(f"wrote {out.relative_to(ROOT)} ({out.stat().st_size:,} bytes)")


def main() -> None:
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "convert_hf_to_gguf.py").is_file():
        sys.exit(__doc__)
    converter = Path(sys.argv[1]).resolve()
    for name in MODELS:
        write_model(name, converter)


if __name__ == "__main__":
    main()
