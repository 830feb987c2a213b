"""GGUF files of Mamba and Mamba-2 models (issue 48 part 4).

The fixtures (``tests/data/gguf``, made by ``make_fixtures.py`` there) are two tiny
random-weight Hugging Face language models and the GGUFs that llama.cpp's own
``convert_hf_to_gguf.py`` wrote of them, F32, F16, BF16 and Q8_0. A GGUF's tensors are the
directory's, rounded as its type says; its A is the converter's ``-torch.exp(A_log)``,
which numpy's float32 exp does not reproduce bit for bit, so the reference each GGUF is
held to is the directory's model with A replaced by the GGUF's (``model_tensors._decay``): the
same bits at batch 1 and 8, stepping and prefill, and the same fingerprint (which hashes
every tensor). Its tokenizer, rebuilt from the metadata, is held to the ``tokenizer.json``
it came from; bad files are refused by name; a real worker serves one and generates text.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer

from ssmserve.client.sync import Client
from ssmserve.server.engine.loader import bf16_bits, load_model, read_config, read_weights
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.model_tensors import (
    build_model,
    expected_shapes,
    kept_16bit,
    load_bytes,
)
from ssmserve.server.engine.numerics import widened
from ssmserve.server.engine.quantize import Q8Weight, quantizable, quantize_q8_0, to_blocks
from ssmserve.server.engine.recurrent_state import BatchState
from ssmserve.server.engine.tokenizer import load_tokenizer
from ssmserve.server.errors import ModelFormatError
from tests.test_generate import PARAMS, offline
from tests.test_startup_refusals import run_worker
from tests.worker_process import WorkerProcess

DATA = Path(__file__).parent / "data" / "gguf"
ARCHS = ("mamba1", "mamba2")
KINDS = ("f32", "f16", "bf16", "q8_0")


def gguf_file(arch: str, kind: str) -> Path:
    return DATA / f"{arch}-{kind}.gguf"


def stored_a(path: Path) -> dict[str, np.ndarray]:
    """Each layer's ``ssm_a`` as the file holds it, read with ``gguf`` alone, keyed as the
    engine keys a stored A (``backbone.layers.{l}.mixer.A``) at A_log's shape."""
    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        if t.name.endswith(".ssm_a"):
            layer = t.name.split(".")[1]
            a = np.array(t.data, np.float32)
            out[f"backbone.layers.{layer}.mixer.A"] = a if a.shape[-1] != 1 else a[:, 0]
    return out


def rounded(arch: str, kind: str) -> dict[str, Any]:
    """The directory's tensors as the converter stores them at ``--outtype kind``: the
    products' weights and the embedding table (all it does not keep in F32) rounded to
    F16 / BF16, or quantised to Q8_0 where a row is whole 32-blocks and F16 elsewhere, as
    ``quantize.quantize_q8_0`` (llama.cpp's reference) does; A replaced by the GGUF's."""
    directory = DATA / arch
    tensors: dict[str, Any] = dict(read_weights(directory, read_config(directory)))
    for name in list(tensors):
        value = tensors[name]
        if name.endswith(".A_log"):
            del tensors[name]
        elif not kept_16bit(name) or kind == "f32":
            continue
        elif kind == "bf16":
            tensors[name] = bf16_bits(value)  # kept 16-bit, as a BF16 load keeps it
        elif kind == "q8_0" and quantizable(value.shape):
            tensors[name] = quantize_q8_0(value)
        else:  # f16, and Q8_0's fallback
            tensors[name] = value.astype(np.float16).astype(np.float32)
    tensors.update(stored_a(gguf_file(arch, kind)))
    return tensors


def reference(arch: str, kind: str) -> MambaModel:
    return build_model(read_config(DATA / arch), rounded(arch, kind), name="reference")


@pytest.fixture(scope="module")
def loaded() -> dict[tuple[str, str], MambaModel]:
    return {(a, k): load_model(gguf_file(a, k)) for a in ARCHS for k in KINDS}


def assert_same_bits(a: MambaModel, b: MambaModel) -> None:
    """Steps at batch 1 and 8 (outputs and states), prefill, and prefill == steps."""
    vocab = a.config.vocab_size
    for batch in (1, 8):
        x = np.random.default_rng(batch).integers(0, vocab, (batch, 4))
        states = [BatchState.stack([m.new_state() for _ in range(batch)]) for m in (a, b)]
        for t in range(x.shape[1]):
            (states[0], ya), (states[1], yb) = (
                a.step(states[0], x[:, t]),
                b.step(states[1], x[:, t]),
            )
            assert ya.tobytes() == yb.tobytes(), (batch, t)
        for sa, sb in zip(states[0].ssm, states[1].ssm, strict=True):
            assert sa.tobytes() == sb.tobytes()
    ids = np.random.default_rng(0).integers(0, vocab, 33)
    (pa, qa), (pb, qb) = a.prefill(ids), b.prefill(ids)
    assert pa.tobytes() == pb.tobytes()
    for la, lb in zip(qa.layers, qb.layers, strict=True):
        assert la.ssm.tobytes() == lb.ssm.tobytes() and la.conv.tobytes() == lb.conv.tobytes()
    stepped, _ = a.run(ids)
    assert stepped.tobytes() == pa.tobytes()


# ------------------------------------------------------------------------ what is read


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_gguf_has_the_config_of_the_directory_it_came_from(arch, kind, loaded):
    assert read_config(gguf_file(arch, kind)) == read_config(DATA / arch)
    assert loaded[arch, kind].config == read_config(DATA / arch)
    assert loaded[arch, kind].name == f"{arch}-{kind}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_gguf_gives_the_bits_of_its_directory_rounded_as_stored(arch, kind, loaded):
    """The fingerprint hashes every tensor: equal, every tensor is the reference's."""
    model, ref = loaded[arch, kind], reference(arch, kind)
    assert model.fingerprint == ref.fingerprint
    assert_same_bits(model, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_f32_gguf_differs_from_its_directory_only_through_the_last_bits_of_A(arch, loaded):
    """The converter's A is torch's ``-exp(A_log)``; the directory's, numpy's: within 2 ulp
    of each other. So the outputs agree closely, and the fingerprints differ (a checkpoint
    of one is refused by the other)."""
    directory = DATA / arch
    tensors = read_weights(directory, read_config(directory))
    for name, a in stored_a(gguf_file(arch, "f32")).items():
        ours = -np.exp(tensors[name + "_log"])
        ulps = np.abs(a.view(np.int32).astype(np.int64) - ours.view(np.int32))
        assert ulps.max() <= 2, name
    hf, model = load_model(directory), loaded[arch, "f32"]
    assert model.fingerprint != hf.fingerprint
    ids = np.random.default_rng(1).integers(0, hf.config.vocab_size, 48)
    a, b = model.run(ids)[0], hf.run(ids)[0]
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())


def test_each_type_is_held_as_the_engine_holds_it(loaded):
    """F16 and BF16 products and the embedding table stay 16-bit; Q8_0 stays 8-bit where a
    row is whole 32-blocks (Mamba-1's dt_proj, rank 2, came as F16: kept 16-bit)."""
    formats = {kind: {lin.format for lin in loaded["mamba1", kind].linears} for kind in KINDS}
    assert formats == {"f32": {"f32"}, "f16": {"f16"}, "bf16": {"bf16"},
                       "q8_0": {"q8_0", "f16"}}  # fmt: skip
    for lin in loaded["mamba1", "q8_0"].linears:
        assert lin.format == ("q8_0" if lin.in_features % 32 == 0 else "f16")
    assert loaded["mamba1", "bf16"].embeddings.dtype == np.uint16  # untied
    assert loaded["mamba1", "f16"].embeddings.dtype == np.int16
    assert isinstance(loaded["mamba1", "q8_0"].embeddings, Q8Weight)
    assert {lin.format for lin in loaded["mamba2", "q8_0"].linears} == {"q8_0"}  # tied head


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_blocks_are_llama_cpps_quantiser_bytes(arch):
    """Every Q8_0 tensor the converter wrote is, byte for byte, ``quantize_q8_0`` of the
    directory's tensor: one quantiser (llama.cpp's reference), one result."""
    directory = DATA / arch
    tensors = read_weights(directory, read_config(directory))
    names = {"token_embd.weight": "backbone.embeddings.weight", "output.weight": "lm_head.weight"}
    mixer = {"ssm_in": "in_proj", "ssm_x": "x_proj", "ssm_dt": "dt_proj", "ssm_out": "out_proj"}
    seen = 0
    for t in gguf.GGUFReader(gguf_file(arch, "q8_0")).tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
            continue
        _blk, layer, module, _ = (*t.name.split("."), "", "")[:4]
        name = names.get(t.name) or f"backbone.layers.{layer}.mixer.{mixer[module]}.weight"
        mine = to_blocks(quantize_q8_0(tensors[name]))
        assert np.array_equal(mine.reshape(-1), np.asarray(t.data).reshape(-1)), t.name
        seen += 1
    assert seen >= 4


@pytest.mark.parametrize("arch", ARCHS)
def test_a_q8_0_gguf_is_load_model_q8_0_of_its_directory(arch, tmp_path):
    """``load_model(dir, quantize="q8_0")`` and the Q8_0 GGUF: the same bits, once each has
    the other's A, and (Mamba-1) dt_proj rounded to F16 as the converter stores a weight
    Q8_0 does not apply to."""
    directory = DATA / arch
    config = read_config(directory)
    t = dict(read_weights(directory, config, keep_bf16=True, quantize="q8_0"))
    for name in [n for n in t if n.endswith(".A_log")]:
        del t[name]
    t.update(stored_a(gguf_file(arch, "q8_0")))
    for name in [n for n in t if n.endswith("dt_proj.weight")]:
        t[name] = widened(t[name]).astype(np.float16).astype(np.float32)
    via_dir = build_model(config, t, name="dir-q8")
    assert_same_bits(load_model(gguf_file(arch, "q8_0")), via_dir)


def test_quantize_q8_0_of_an_f32_gguf_is_the_q8_0_gguf():
    """Mamba-2 (every product weight is whole 32-blocks): quantising an F32 GGUF at load
    gives the model the converter's Q8_0 file holds."""
    mine = load_model(gguf_file("mamba2", "f32"), quantize="q8_0")
    theirs = load_model(gguf_file("mamba2", "q8_0"))
    assert mine.fingerprint == theirs.fingerprint
    assert_same_bits(mine, theirs)
    with pytest.raises(ValueError, match="q8_0"):
        load_model(gguf_file("mamba2", "f32"), quantize="q4_0")


def test_a_gguf_load_stays_within_the_memory_it_was_checked_for(tmp_path):
    """A Q8_0 GGUF of a bigger model: the peak is within ``load_bytes`` of its stored types
    (Q8_0 weights count 1.125 bytes a value, read and held)."""
    import tracemalloc

    src = gguf_file("mamba1", "q8_0")
    rng = np.random.default_rng(5)
    vocab, d = 24576, 32

    def embd(t: Any) -> np.ndarray:
        values = rng.standard_normal((vocab, d)).astype(np.float32)
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)

    big = rewrite(src, tmp_path / "big.gguf", tensors={"token_embd.weight": embd,
                                                       "output.weight": embd})  # fmt: skip
    config = read_config(big)
    stored = {n: ("Q8_0" if kept_16bit(n) and quantizable(s) else "F32")
              for n, s in expected_shapes(config).items()}  # fmt: skip
    tracemalloc.start()
    try:
        model = load_model(big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert model.config.vocab_size == vocab
    assert peak <= load_bytes(config, stored, keep_bf16=True)


# ------------------------------------------------------------------------- tokenizer

TEXTS = [
    "Hello world",
    " Hello World!",
    "The quick brown fox jumps over the lazy dog.",
    "Café, naïve, façade, Zürich, İstanbul, Ærøskøbing",
    "Ελληνικά русский 中文字符 日本語のテキスト 한국어 עברית العربية हिन्दी",
    "🚀 🦙 ✅ 😁 👍🏽 👨‍👩‍👧 and 😶‍🌫️",
    "e\u0301 vs \u00e9, A\u030a vs \u00c5 (combining marks)",
    "   three spaces, \t tab, \n\n\n newlines,\r\n CRLF,       many",
    "trailing   \n",
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n",
    "0 1 12 123 1234 12345 3.14159 1e-5 0x1F 1,000,000 -42",
    "def step(state, token):\n    return state * decay + token  # one step\n",
    "if (x >= 0 && y != 1) { return x + y; } else { return -1; }",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you",
    "<|endoftext|> a special token in the text, and <|padding|> too",
    "'''''' ``````` \"\"\"\" ...... !!!!!! ?????? ------======= ~~~",
    "कांतेपिसेसअच😁 ?我想在apple工作1314151天～",
    "\u200b zero width, \u00a0 no-break, \ufeff BOM",
    "x",
    "",
]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_tokenizer_inside_a_gguf_is_the_one_it_was_converted_from(arch):
    """Ids and decoded text as the directory's ``tokenizer.json`` gives them (Mamba-2's
    adds a BOS, Mamba-1's does not), for every type of the file."""
    hf = Tokenizer.from_file(str(DATA / arch / "tokenizer.json"))
    vocab = read_config(DATA / arch).vocab_size
    for kind in KINDS:
        tok = load_tokenizer(gguf_file(arch, kind), vocab)
        assert tok is not None
        for text in TEXTS:
            ids = hf.encode(text).ids
            assert tok.encode(text).tolist() == ids, (kind, text)
            assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), (kind, text)
    assert (hf.encode("x").ids[0] == 0) == (arch == "mamba2")  # the BOS
    ids = list(hf.get_vocab().values())
    rng = np.random.default_rng(2)
    for _ in range(200):  # any ids, bytes of a character split included
        some = [int(i) for i in rng.choice(ids, rng.integers(1, 12))]
        assert tok.decode(some) == hf.decode(some, skip_special_tokens=True), some


def test_a_tokenizer_json_beside_a_gguf_is_used_instead(tmp_path):
    shutil.copy(gguf_file("mamba1", "f16"), tmp_path / "m.gguf")
    assert (
        load_tokenizer(tmp_path / "m.gguf", 384).fingerprint
        != load_tokenizer(DATA / "mamba1", 384).fingerprint
    )
    shutil.copy(DATA / "mamba1" / "tokenizer.json", tmp_path)
    assert (
        load_tokenizer(tmp_path / "m.gguf", 384).fingerprint
        == load_tokenizer(DATA / "mamba1", 384).fingerprint
    )


def test_a_gguf_without_a_tokenizer_serves_ids_and_an_unknown_one_is_refused(tmp_path):
    src = gguf_file("mamba1", "f32")
    none = rewrite(src, tmp_path / "none.gguf", drop_keys=("tokenizer.ggml.",))
    assert load_tokenizer(none, 384) is None
    assert load_model(none).fingerprint == load_model(src).fingerprint
    llama3 = rewrite(src, tmp_path / "llama3.gguf", keys={"tokenizer.ggml.pre": "llama-bpe"})
    with pytest.raises(ModelFormatError, match=r"llama3.gguf.*pre-tokenizer 'llama-bpe'.*beside"):
        load_tokenizer(llama3, 384)
    spm = rewrite(src, tmp_path / "spm.gguf", keys={"tokenizer.ggml.model": "llama"})
    with pytest.raises(ModelFormatError, match=r"tokenizer.ggml.model 'llama'.*only 'gpt2'"):
        load_tokenizer(spm, 384)
    with pytest.raises(ModelFormatError, match="token id 359, outside the model's 300"):
        load_tokenizer(src, 300)


# ------------------------------------------------------------------------- bad files


def rewrite(
    src: Path,
    dst: Path,
    keys: dict[str, Any] | None = None,
    drop_keys: tuple[str, ...] = (),
    tensors: dict[str, Any] | None = None,
) -> Path:
    """A copy of the GGUF ``src`` written by ``gguf.GGUFWriter``, with metadata ``keys``
    set (strings; an existing key keeps its type), keys starting with ``drop_keys`` left
    out, and ``tensors``: name -> None (left out) or a function of the reader's tensor
    giving (data, GGUF type) or just the data (stored in its own type)."""
    keys, tensors = keys or {}, tensors or {}
    reader = gguf.GGUFReader(src)
    arch = keys.get("general.architecture", reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")) or key.startswith(drop_keys):
            continue
        value = keys.get(key, field.contents())
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for key, value in keys.items():
        if key not in reader.fields and key != "general.architecture":
            kind = gguf.GGUFValueType.get_type(value)
            writer.add_key_value(key, value, kind)
    done = set()
    for t in reader.tensors:
        change = tensors.get(t.name, ...)
        done.add(t.name)
        if change is None:
            continue
        if change is ...:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        out = change(t)
        data, kind = out if isinstance(out, tuple) else (out, None)
        if kind is None and data.dtype == np.uint8:
            kind = t.tensor_type
        writer.add_tensor(t.name, data, raw_dtype=kind)
    for name, change in tensors.items():
        if name not in done and change is not None:
            out = change(None)
            data, kind = out if isinstance(out, tuple) else (out, None)
            writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_the_rewriter_keeps_a_file_as_it_was(tmp_path):
    copy = rewrite(gguf_file("mamba2", "bf16"), tmp_path / "same.gguf")
    assert load_model(copy).fingerprint == load_model(gguf_file("mamba2", "bf16")).fingerprint


def _q4(t: Any) -> tuple[np.ndarray, Any]:
    q4 = gguf.GGMLQuantizationType.Q4_0
    return gguf.quants.quantize(gguf.quants.dequantize(t.data, t.tensor_type), q4), q4


def _nan(t: Any) -> np.ndarray:
    data = np.array(t.data, np.float32)
    data.reshape(-1)[3] = np.nan
    return data


BAD = {
    "unknown architecture": (
        {"keys": {"general.architecture": "llama"}},
        r"architecture 'llama' is not served here.*'mamba', 'mamba2'",
    ),
    "FalconMamba": (
        {"keys": {"mamba.ssm.dt_b_c_rms": True}},
        r"a FalconMamba GGUF .*mixer_rms_eps",
    ),
    "missing key": (
        {"drop_keys": ("mamba.ssm.state_size",)},
        r"metadata key 'mamba.ssm.state_size' is missing",
    ),
    "missing tensor": ({"tensors": {"blk.1.ssm_d": None}}, r"missing tensor\(s\) blk.1.ssm_d"),
    "unexpected tensor": (
        {"tensors": {"blk.0.ssm_b_norm.weight": lambda _t: np.ones(8, np.float32)}},
        r"unexpected tensor\(s\) 'blk.0.ssm_b_norm.weight'",
    ),
    "wrong shape": (
        {"tensors": {"blk.0.ssm_d": lambda t: np.array(t.data)[:60]}},
        r"tensor 'blk.0.ssm_d' has shape \[60\] .*the metadata need \[64\]",
    ),
    "unsupported type": (
        {"tensors": {"blk.0.ssm_in.weight": _q4}},
        r"tensor 'blk.0.ssm_in.weight' is Q4_0; supported: F32, F16, BF16, Q8_0",
    ),
    "NaN": (
        {"tensors": {"blk.1.ssm_conv1d.weight": _nan}},
        r"tensor 'blk.1.ssm_conv1d.weight' contains NaN or Inf",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_gguf_is_refused_naming_what_is_wrong(case, tmp_path):
    changes, message = BAD[case]
    bad = rewrite(gguf_file("mamba1", "q8_0"), tmp_path / "bad.gguf", **changes)
    with pytest.raises(ModelFormatError, match=r"bad\.gguf: " + message):
        load_model(bad)


def test_a_cut_short_or_foreign_file_is_refused(tmp_path):
    data = gguf_file("mamba2", "f32").read_bytes()
    for cut in (len(data) - 1, len(data) // 2):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ModelFormatError, match=r"cut.gguf: tensor .* ends at .* cut short"):
            load_model(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:200])  # inside the metadata
    with pytest.raises(ModelFormatError, match=r"head.gguf: not a readable GGUF file \(200 bytes"):
        load_model(tmp_path / "head.gguf")
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelFormatError, match=r"x.gguf: not a readable GGUF file.*magic"):
        load_model(tmp_path / "x.gguf")
    (tmp_path / "v9.gguf").write_bytes(b"GGUF" + struct.pack("<I", 9) + data[8:])
    with pytest.raises(ModelFormatError, match=r"v9.gguf: not a readable GGUF file.*version 9"):
        load_model(tmp_path / "v9.gguf")
    with pytest.raises(ModelFormatError, match=r"GGUF file '.*nowhere.gguf' does not exist"):
        load_model(tmp_path / "nowhere.gguf")
    (tmp_path / "noext").write_bytes(data)  # a GGUF by its magic, whatever its name
    same = load_model(gguf_file("mamba2", "f32")).fingerprint
    assert load_model(tmp_path / "noext").fingerprint == same


def test_the_server_refuses_a_bad_gguf_at_start(tmp_path):
    bad = rewrite(gguf_file("mamba1", "f32"), tmp_path / "bad.gguf",
                  tensors={"blk.0.ssm_in.weight": _q4})  # fmt: skip
    result = run_worker(["--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"),
                         "--model", f"lm={bad}"])  # fmt: skip
    assert result.returncode not in (0, -1), result.stdout
    assert "bad.gguf: tensor 'blk.0.ssm_in.weight' is Q4_0" in result.stderr, result.stderr


# ------------------------------------------------------------------------ served


def test_a_worker_serves_a_gguf_and_generates_text(tmp_path):
    """``ssmserve-server --model lm=FILE.gguf``, a real process: the GGUF's own tokenizer
    (no tokenizer.json beside it) takes the prompt text, and the tokens drawn are the
    offline engine's from the same ids."""
    path = gguf_file("mamba2", "q8_0")
    worker = WorkerProcess({"lm": path}, None, tmp_path / "w", lease_ttl_s=5.0).start(60)
    try:
        with Client(worker.address) as client:
            session = client.create_session("lm")
            tokens = list(client.generate(session, 12, prompt_text="Mamba reads ", **PARAMS))
            models = {m.key: m for m in client.list_models().models}
        tok = load_tokenizer(path, 384)
        assert tok is not None
        prompt = tok.encode("Mamba reads ").tolist()
        expected, _, _ = offline(load_model(path), prompt, 12)
        assert [t.token_id for t in tokens] == expected
        assert "".join(t.text for t in tokens) == tok.decode(expected)
        assert models["lm"].tokenizer_fingerprint == tok.fingerprint
    finally:
        worker.kill()


def test_ssmserve_model_inspect_and_run_take_a_gguf(tmp_path):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(10, dtype=np.int64))
    path = gguf_file("mamba1", "bf16")
    cli = [sys.executable, "-m", "ssmserve.client.cli", "model"]
    inspect = subprocess.run([*cli, "inspect", str(path)], capture_output=True, text=True)
    assert inspect.returncode == 0, inspect.stderr
    assert load_model(path).fingerprint in inspect.stdout
    out = tmp_path / "out.npy"
    run = subprocess.run([*cli, "run", str(path), "--input", str(ids), "--output", str(out)],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert np.load(out).tobytes() == load_model(path).run(np.arange(10))[0].tobytes()


def test_the_gpu_engine_refuses_a_gguf_by_name():
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from ssmserve.server.engine.gpu.model import GpuMambaModel

    with pytest.raises(ModelFormatError, match=r"mamba2-f32.gguf: the GPU engine does not read"):
        GpuMambaModel.load(gguf_file("mamba2", "f32"))


def test_a_gguf_too_big_for_this_machine_is_refused_before_its_data_is_read(tmp_path):
    """A GGUF whose header describes a model needing twice the memory available here (its
    data a sparse file: nothing written, nothing read): InsufficientMemoryError, at once."""
    from ssmserve.server.engine.gguf_model import _sources
    from ssmserve.server.errors import InsufficientMemoryError
    from tests.test_model_loader import _too_big_for_this_machine

    _too_big_for_this_machine(tmp_path / "dir")
    config = read_config(tmp_path / "dir")
    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(path, "mamba")
    for key, value in {"embedding_length": config.hidden_size,
                       "block_count": config.num_hidden_layers,
                       "ssm.conv_kernel": config.conv_kernel,
                       "ssm.inner_size": config.intermediate_size,
                       "ssm.state_size": config.state_size,
                       "ssm.time_step_rank": config.time_step_rank}.items():  # fmt: skip
        writer.add_uint32(f"mamba.{key}", value)
    writer.add_float32("mamba.attention.layer_norm_rms_epsilon", config.layer_norm_epsilon)
    data = 0
    for source in _sources(config).values():
        nbytes = 4 * int(np.prod(source.shape))
        writer.add_tensor_info(source.name, source.shape, np.dtype(np.float32), nbytes)
        data += nbytes + 32
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with path.open("r+b") as fh:
        fh.truncate(path.stat().st_size + 32 + data)  # sparse: no block of it is written
    assert read_config(path) == config
    with pytest.raises(InsufficientMemoryError, match=r"'big' needs about [\d.]+ GiB"):
        load_model(path)
