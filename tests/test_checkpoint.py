"""Checkpoint codec: exact round trips, zero-copy decode, typed errors for bad blobs."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import replace
from pathlib import Path

import msgpack
import numpy as np
import pytest
import xxhash

from ssmserve.server.engine.demo import DemoSpec, demo_config
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.errors import (
    CheckpointChecksumError,
    CheckpointError,
    CheckpointLayoutError,
    CheckpointMagicError,
    CheckpointModelMismatchError,
    CheckpointTruncatedError,
    CheckpointVersionError,
    ErrorKind,
)
from ssmserve.server.state.checkpoint import (
    FORMAT_VERSION,
    MAGIC,
    Checkpoint,
    CheckpointMeta,
    GuardState,
    InputHistory,
    RuleState,
)
from tests.conftest import random_inputs, write_model


def make_checkpoint(
    model: MambaModel, steps: int = 20, window: int = 8, seed: int = 0
) -> tuple[Checkpoint, np.ndarray]:
    inputs = random_inputs(model, steps + 30, seed)
    _, state = model.run(inputs[:steps])
    first = max(1, steps - window + 1)
    ckpt = Checkpoint(
        session_id=f"sess-{seed}",
        step=steps,
        model_id=model.name,
        fingerprint=model.fingerprint,
        state=state,
        history=InputHistory(first, inputs[first - 1 : steps]),
        meta=CheckpointMeta(
            created_at=1700000000.5, reason="periodic", label="before-spike", tags={"who": "test"}
        ),
    )
    return ckpt, inputs


def payload_start(blob: bytes) -> int:
    """Where the payload starts: right after the header (format 1), or at the next
    multiple of 8 (format 2)."""
    version, hlen = struct.unpack_from("<H", blob, 8)[0], struct.unpack_from("<I", blob, 12)[0]
    return 24 + hlen + (-(24 + hlen) % 8 if version == 2 else 0)


def seal(body: bytes) -> bytes:
    """``body`` with the checksum its format version asks for."""
    if struct.unpack_from("<H", body, 8)[0] == 1:
        return body + hashlib.sha256(body).digest()
    return body + xxhash.xxh3_128_digest(body)


def reseal(blob: bytes, header: dict) -> bytes:
    """Rebuild a blob with a replaced header and a valid checksum (exercises validation)."""
    _, version, flags, _, plen = struct.unpack_from("<8sHHIQ", blob)
    start = payload_start(blob)
    payload = blob[start : start + plen]
    new_header = msgpack.packb(header, use_bin_type=True)
    prefix = struct.pack("<8sHHIQ", MAGIC, version, flags, len(new_header), plen)
    pad = b"\0" * (-(24 + len(new_header)) % 8 if version == 2 else 0)
    return seal(prefix + new_header + pad + payload)


def header_of(blob: bytes) -> dict:
    hlen = struct.unpack_from("<I", blob, 12)[0]
    return msgpack.unpackb(blob[24 : 24 + hlen], raw=False)


@pytest.mark.parametrize(
    "model_name", ["signal_model", "token_model", "mamba2_model", "mamba2_token_model"]
)
def test_round_trip_and_exact_continuation(model_name: str, request: pytest.FixtureRequest) -> None:
    model: MambaModel = request.getfixturevalue(model_name)
    ckpt, inputs = make_checkpoint(model)
    decoded = Checkpoint.decode(ckpt.encode())
    decoded.check_model(model)
    assert decoded.session_id == ckpt.session_id and decoded.step == 20
    assert decoded.model_id == model.name and decoded.fingerprint == model.fingerprint
    assert decoded.meta == ckpt.meta
    assert decoded.state.bit_equal(ckpt.state)
    assert decoded.history.first_step == 13 and decoded.history.last_step == 20
    assert np.array_equal(decoded.history.inputs, ckpt.history.inputs)
    assert decoded.history.inputs.dtype == (np.int64 if model.config.is_token_model else np.float32)
    # restore then continue == never stopping
    uninterrupted, _ = model.run(inputs)
    continued, _ = model.run(inputs[20:], decoded.state)
    assert np.array_equal(continued, uninterrupted[20:])


def test_encode_is_deterministic(signal_model: MambaModel) -> None:
    ckpt, _ = make_checkpoint(signal_model)
    assert ckpt.encode() == ckpt.encode() == Checkpoint.decode(ckpt.encode()).encode()


def test_decode_does_not_copy_arrays(signal_model: MambaModel) -> None:
    blob = make_checkpoint(signal_model)[0].encode()
    decoded = Checkpoint.decode(blob)
    arrays = [a for layer in decoded.state.layers for a in (layer.conv, layer.ssm)]
    arrays.append(decoded.history.inputs)
    backing = np.frombuffer(blob, np.uint8)
    assert all(np.shares_memory(a, backing) for a in arrays)
    assert not any(a.flags.writeable for a in arrays)  # views of immutable bytes


def test_empty_history_and_step_zero(signal_model: MambaModel) -> None:
    empty = np.zeros((0, signal_model.config.input_dim), np.float32)
    ckpt = Checkpoint(
        "s", 0, "m", signal_model.fingerprint, signal_model.new_state(), InputHistory(1, empty)
    )
    decoded = Checkpoint.decode(ckpt.encode())
    assert decoded.step == 0 and decoded.history.inputs.shape == (0, signal_model.config.input_dim)
    decoded.check_model(signal_model)


def test_bad_magic(signal_model: MambaModel) -> None:
    blob = make_checkpoint(signal_model)[0].encode()
    for bad in (b"", b"hello", b"PK\x03\x04" + blob[4:], b"{}", blob[1:]):
        with pytest.raises(
            CheckpointMagicError if bad[:1] not in (b"", MAGIC[:1]) else CheckpointError
        ):
            Checkpoint.decode(bad)


def test_unsupported_version_and_flags(signal_model: MambaModel) -> None:
    blob = bytearray(make_checkpoint(signal_model)[0].encode())
    v3 = bytes(blob[:8]) + struct.pack("<H", 3) + bytes(blob[10:])
    with pytest.raises(CheckpointVersionError, match="version 3 is not supported"):
        Checkpoint.decode(v3)
    with pytest.raises(CheckpointVersionError, match="format 3"):
        make_checkpoint(signal_model)[0].encode(format_version=3)
    flagged = bytes(blob[:10]) + struct.pack("<H", 1) + bytes(blob[12:])
    with pytest.raises(CheckpointVersionError, match="flags"):
        Checkpoint.decode(flagged)


def test_truncation_and_trailing_bytes(signal_model: MambaModel) -> None:
    blob = make_checkpoint(signal_model)[0].encode()
    for cut in (9, 24, 40, len(blob) // 2, len(blob) - 1):
        with pytest.raises(CheckpointTruncatedError):
            Checkpoint.decode(blob[:cut])
    with pytest.raises(CheckpointTruncatedError, match="extra bytes"):
        Checkpoint.decode(blob + b"\0")


@pytest.mark.parametrize("version", [1, 2])
def test_checksum_mismatch(signal_model: MambaModel, version: int) -> None:
    blob = bytearray(make_checkpoint(signal_model)[0].encode(version))
    for pos in (30, len(blob) // 2, len(blob) - 40, len(blob) - 1):
        corrupted = bytearray(blob)
        corrupted[pos] ^= 0x01
        with pytest.raises(CheckpointChecksumError):
            Checkpoint.decode(bytes(corrupted))


@pytest.mark.parametrize("version", [1, 2])
def test_the_checksum_catches_any_flipped_bit_of_the_state(
    signal_model: MambaModel, version: int
) -> None:
    """Every bit of a state float (sign, exponent, mantissa) in the first, a middle and the
    last layer: the header's lengths still agree, only the checksum can tell."""
    ckpt = make_checkpoint(signal_model)[0]
    blob = ckpt.encode(version)
    state = header_of(blob)["arrays"][0] if version == 1 else header_of(blob)["state"]["array"]
    start = payload_start(blob) + state[-2]
    nbytes = ckpt.state.nbytes if version == 2 else state[-1]
    for pos in (start, start + nbytes // 2 + 1, start + nbytes - 1):
        for bit in range(8):
            corrupted = bytearray(blob)
            corrupted[pos] ^= 1 << bit
            with pytest.raises(CheckpointChecksumError, match="checksum mismatch"):
                Checkpoint.decode(bytes(corrupted))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda h: h.update(step=-1), "negative"),
        (lambda h: h.update(step="20"), "wrong type"),
        (lambda h: h.pop("model"), "lacks 'model'"),
        (lambda h: h.update(session_id=""), "empty"),
        (lambda h: h["arrays"][0].__setitem__(1, "<f8"), "dtype"),
        (lambda h: h["arrays"][0].__setitem__(1, "|O"), "dtype"),
        (lambda h: h["arrays"][0].__setitem__(2, [999, 999]), "needs"),
        (lambda h: h["arrays"][0].__setitem__(3, 1 << 40), "outside the payload"),
        (lambda h: h["arrays"][1].__setitem__(3, h["arrays"][0][3]), "overlap"),
        (lambda h: h["arrays"][0].__setitem__(0, "layers.7.conv_state"), "unexpected state"),
        (lambda h: h.update(arrays=h["arrays"][:-1]), "pairs"),
        (lambda h: h.update(arrays=[]), "no layers"),
        (lambda h: h["history"].__setitem__(0, 3), "history covers"),
        (lambda h: h["history"].__setitem__(1, "<i4"), "dtype"),
        (lambda h: h["meta"].update(tags={"k": 1}), "tags"),
        (lambda h: h["meta"].update(created_at=float("nan")), "finite"),
    ],
)
def test_inconsistent_header_is_a_layout_error(
    signal_model: MambaModel, mutate, message: str
) -> None:
    blob = make_checkpoint(signal_model)[0].encode(format_version=1)
    header = header_of(blob)
    mutate(header)
    with pytest.raises(CheckpointLayoutError, match=message):
        Checkpoint.decode(reseal(blob, header))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda h: h.pop("state"), "lacks 'state'"),
        (lambda h: h.update(state=[1, 2]), "state has the wrong type"),
        (lambda h: h["state"].update(layers=0), "no layers"),
        (lambda h: h["state"].update(layers=True), "wrong type"),
        (lambda h: h["state"].update(layers=1 << 62), "floats, its array has shape"),
        (lambda h: h["state"].update(layers=h["state"]["layers"] - 1), "floats"),
        (lambda h: h["state"].update(conv=[4]), "state.conv must be 2"),
        (lambda h: h["state"].update(conv=[4, 0]), "positive"),
        (lambda h: h["state"].update(ssm=[1, 2, 3, 4]), "state.ssm must be 2 or 3"),
        (lambda h: h["state"].update(ssm=[7, "n"]), "state.ssm"),
        (lambda h: h["state"]["conv"].__setitem__(0, h["state"]["conv"][0] + 1), "disagree"),
        (lambda h: h["state"]["array"].__setitem__(0, "<f8"), "dtype"),
        (lambda h: h["state"]["array"].__setitem__(1, [2, 3]), "needs"),
        (lambda h: h["state"]["array"].__setitem__(2, 1 << 40), "outside the payload"),
        (lambda h: h["history"].__setitem__(3, h["state"]["array"][2]), "overlap"),
        (lambda h: h["history"].__setitem__(0, 3), "history covers"),
        (lambda h: h["meta"].update(tags={"k": 1}), "tags"),
    ],
)
def test_inconsistent_format2_header_is_a_layout_error(
    signal_model: MambaModel, mutate, message: str
) -> None:
    blob = make_checkpoint(signal_model)[0].encode()
    assert struct.unpack_from("<H", blob, 8)[0] == FORMAT_VERSION == 2
    header = header_of(blob)
    mutate(header)
    with pytest.raises(CheckpointLayoutError, match=message):
        Checkpoint.decode(reseal(blob, header))


@pytest.mark.parametrize("model_name", ["signal_model", "mamba2_model", "mamba2_token_model"])
@pytest.mark.parametrize("with_output", [False, True])
@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("packed", [False, True])
def test_format2_round_trips(
    model_name: str, with_output: bool, window: int, packed: bool, request: pytest.FixtureRequest
) -> None:
    """Mamba-1 and Mamba-2 state shapes, with and without the output and the history, from
    a state of per-layer arrays and from a packed one: the same bytes, decoded exactly."""
    model: MambaModel = request.getfixturevalue(model_name)
    ckpt, inputs = make_checkpoint(model)
    if not window:
        empty = inputs[:0]
        ckpt = replace(ckpt, history=InputHistory(ckpt.step + 1, empty))
    if with_output:
        ckpt = replace(ckpt, output=model.run(inputs[:20])[0][-1])
    if packed:
        ckpt = replace(ckpt, state=ckpt.state.copy())
        assert ckpt.state.packed_buffer() is not None
    blob = ckpt.encode()
    assert blob == replace(ckpt, state=SessionState(ckpt.state.layers)).encode()
    decoded = Checkpoint.decode(blob)
    decoded.check_model(model)
    assert decoded.state.bit_equal(ckpt.state) and decoded.meta == ckpt.meta
    assert decoded.history.first_step == ckpt.history.first_step
    assert decoded.history.inputs.tobytes() == ckpt.history.inputs.tobytes()
    assert (decoded.output is None) == (not with_output)
    if with_output:
        assert decoded.output.tobytes() == ckpt.output.tobytes()
    # format 1 holds the same checkpoint, in more bytes
    again = Checkpoint.decode(ckpt.encode(format_version=1))
    assert again.state.bit_equal(decoded.state) and again.encode() == blob


def test_format2_bytes_and_zero_copy_decode(mamba2_model: MambaModel) -> None:
    ckpt = make_checkpoint(mamba2_model)[0]
    blob = ckpt.encode()
    assert blob[:10] == MAGIC + struct.pack("<H", 2)
    start, plen = payload_start(blob), struct.unpack_from("<Q", blob, 16)[0]
    assert start % 8 == 0 and len(blob) == start + plen + 16
    assert blob[-16:] == xxhash.xxh3_128_digest(blob[:-16])
    decoded = Checkpoint.decode(blob)
    buffer = decoded.state.packed_buffer()
    assert buffer is not None and not buffer.flags.writeable
    assert np.shares_memory(buffer, np.frombuffer(blob, np.uint8))
    assert buffer.tobytes() == ckpt.state.packed().tobytes()


FORMAT1 = Path(__file__).parent / "fixtures" / "checkpoint_format1"


@pytest.mark.parametrize("name", ["mamba1", "mamba2"])
def test_format1_checkpoints_still_load(name: str) -> None:
    """Blobs written by the format-1 encoder (``make_fixture.py``) decode to the state,
    history and output they were made of; encoding format 1 still gives the same bytes,
    and the same checkpoint re-encodes to format 2."""
    blob = (FORMAT1 / f"{name}.ckpt").read_bytes()
    assert struct.unpack_from("<H", blob, 8)[0] == 1
    facts = json.loads((FORMAT1 / "expected.json").read_text())[name]
    expected = np.load(FORMAT1 / "expected.npz")
    ckpt = Checkpoint.decode(blob)
    assert (ckpt.session_id, ckpt.step, ckpt.model_id) == (
        f"{name}-session",
        facts["step"],
        f"{name}-model",
    )
    assert ckpt.meta == CheckpointMeta(1700000000.25, "periodic", "v1-fixture", {"k": "v"})
    assert len(ckpt.state.layers) == facts["layers"]
    for i, layer in enumerate(ckpt.state.layers):
        assert layer.conv.tobytes() == expected[f"{name}.{i}.conv"].tobytes()
        assert layer.ssm.tobytes() == expected[f"{name}.{i}.ssm"].tobytes()
        assert layer.ssm.shape == expected[f"{name}.{i}.ssm"].shape
    hist = expected[f"{name}.history"]
    assert ckpt.history.first_step == 10
    assert (
        ckpt.history.inputs.dtype == hist.dtype and ckpt.history.inputs.tobytes() == hist.tobytes()
    )
    if f"{name}.output" in expected:
        assert ckpt.output is not None
        assert ckpt.output.tobytes() == expected[f"{name}.output"].tobytes()
    else:
        assert ckpt.output is None
    assert ckpt.encode(format_version=1) == blob
    assert Checkpoint.decode(ckpt.encode()).state.bit_equal(ckpt.state)


def test_foreign_model_is_refused(
    signal_model: MambaModel, token_model: MambaModel, tmp_path
) -> None:
    ckpt, _ = make_checkpoint(signal_model)
    decoded = Checkpoint.decode(ckpt.encode())
    with pytest.raises(CheckpointModelMismatchError, match="fingerprint") as info:
        decoded.check_model(token_model)
    assert info.value.kind is ErrorKind.FAILED_PRECONDITION
    # same dims, other weights: still refused by fingerprint
    spec = DemoSpec(
        input_dim=5, output_dim=3, hidden=22, layers=3, state=7, expand=3, conv_kernel=3, seed=12
    )
    sibling = write_model(tmp_path / "sibling", demo_config(spec), seed=12)
    with pytest.raises(CheckpointModelMismatchError):
        decoded.check_model(sibling)


def test_matching_fingerprint_but_wrong_state_shape_is_refused(
    signal_model: MambaModel, token_model: MambaModel
) -> None:
    forged = Checkpoint(
        "s",
        0,
        "m",
        signal_model.fingerprint,
        token_model.new_state(),
        InputHistory(1, np.zeros((0, 5), np.float32)),
    )
    with pytest.raises(CheckpointModelMismatchError, match="state does not fit"):
        Checkpoint.decode(forged.encode()).check_model(signal_model)


def test_encode_refuses_inconsistent_history(signal_model: MambaModel) -> None:
    ckpt, _ = make_checkpoint(signal_model)
    bad = Checkpoint(
        ckpt.session_id, ckpt.step + 1, ckpt.model_id, ckpt.fingerprint, ckpt.state, ckpt.history
    )
    with pytest.raises(CheckpointLayoutError, match="history covers"):
        bad.encode()


def test_the_output_of_the_step_round_trips_and_is_optional(signal_model: MambaModel) -> None:
    ckpt, inputs = make_checkpoint(signal_model)
    assert Checkpoint.decode(ckpt.encode()).output is None  # optional: older blobs lack it
    out = signal_model.run(inputs[:20])[0][-1]
    with_output = Checkpoint(
        ckpt.session_id, ckpt.step, ckpt.model_id, ckpt.fingerprint, ckpt.state, ckpt.history,
        ckpt.meta, out,
    )  # fmt: skip
    decoded = Checkpoint.decode(with_output.encode())
    decoded.check_model(signal_model)
    assert (
        decoded.output is not None
        and decoded.output.view(np.uint32).tolist() == out.view(np.uint32).tolist()
    )
    blob = with_output.encode()
    header = header_of(blob)
    header["output"][1] = [3, 1]
    with pytest.raises(CheckpointLayoutError, match="output must be 1-D"):
        Checkpoint.decode(reseal(blob, header))
    header["output"] = "x"
    with pytest.raises(CheckpointLayoutError, match="output has the wrong type"):
        Checkpoint.decode(reseal(blob, header))
    wrong = Checkpoint(
        ckpt.session_id, ckpt.step, ckpt.model_id, ckpt.fingerprint, ckpt.state, ckpt.history,
        ckpt.meta, np.zeros(7, np.float32),
    )  # fmt: skip
    with pytest.raises(CheckpointModelMismatchError, match="model outputs 3 values"):
        Checkpoint.decode(wrong.encode()).check_model(signal_model)


def test_signed_exports_verify_and_forgeries_are_refused() -> None:
    from ssmserve.server.state.checkpoint_signing import (
        TRAILER_BYTES,
        CheckpointSignatureError,
        sign,
        unwrap,
    )

    blob, key = b"checkpoint bytes" * 10, b"k" * 32
    signed = sign(blob, key)
    assert len(signed) == len(blob) + TRAILER_BYTES
    assert unwrap(signed, key, required=True) == (blob, True)
    assert unwrap(signed, None, required=False) == (blob, False)  # no key: unverified
    assert unwrap(blob, key, required=False) == (blob, False)
    tampered = bytearray(signed)
    tampered[3] ^= 1
    for bad, required in (
        (bytes(tampered), False),  # a changed body
        (sign(blob, b"x" * 32), False),  # another key
        (blob, True),  # unsigned where a signature is required
        (signed, True),  # a signature this worker cannot check
    ):
        with pytest.raises(CheckpointSignatureError):
            unwrap(bad, None if bad is signed else key, required)


OLD = Path(__file__).parent / "fixtures" / "checkpoint_v1"


def test_a_checkpoint_written_before_mamba2_still_loads_and_continues_exactly() -> None:
    """A Mamba-1 model and a checkpoint written by ssmserve before Mamba-2 existed: the
    model keeps its fingerprint, the checkpoint decodes and fits it, and stepping on from
    it gives the outputs that version computed (bit for bit on the same numerics: CPU,
    BLAS build and threads, library versions; within 1e-6 elsewhere)."""
    from ssmserve.server.engine.loader import load_model
    from ssmserve.server.engine.numerics import numerics_description

    meta = json.loads((OLD / "meta.json").read_text())
    model = load_model(OLD / "model")
    assert model.fingerprint == meta["fingerprint"]
    ckpt = Checkpoint.decode((OLD / "checkpoint.bin").read_bytes())
    ckpt.check_model(model)
    assert (ckpt.session_id, ckpt.step, ckpt.meta.label) == ("old-session", 12, "before-mamba2")
    x, expected = np.load(OLD / "inputs.npy"), np.load(OLD / "outputs.npy")
    got, _ = model.run(x[12:], ckpt.state)
    same_numerics = (
        numerics_description().rsplit(" | engine ", 1)[0]
        == (meta["numerics"].rsplit(" | engine ", 1)[0])
    )
    if same_numerics:
        assert np.array_equal(got.view(np.uint32), expected[12:].view(np.uint32))
    else:
        np.testing.assert_allclose(got, expected[12:], atol=1e-6)


def _with_guards(ckpt: Checkpoint, guards: GuardState) -> Checkpoint:
    return replace(ckpt, guards=guards)


def test_guard_state_round_trips_and_is_optional(signal_model: MambaModel) -> None:
    """The state of a session's stateful guards (``sessions.stateful_guards``) goes with
    its checkpoint bit for bit; a checkpoint without it (older ones) decodes to None."""
    ckpt, _inputs = make_checkpoint(signal_model)
    assert Checkpoint.decode(ckpt.encode()).guards is None
    guards = GuardState(
        np.arange(5, dtype=np.float32),
        np.array([np.nan, 1.5, -2.0], np.float32),  # an output a REPORT rule let through
        (
            RuleState("spike", np.array([0.1, 0.2, 0.3, 0.4, 0.5]), None),
            RuleState("stuck", None, np.array([0, 3], np.int64)),
            RuleState("plain"),
        ),
    )
    for version in (1, 2):
        decoded = Checkpoint.decode(_with_guards(ckpt, guards).encode(version))
        decoded.check_model(signal_model)
        g = decoded.guards
        assert g is not None and g.last_input is not None and g.last_output is not None
        assert g.last_input.tobytes() == guards.last_input.tobytes()  # type: ignore[union-attr]
        assert g.last_output.tobytes() == guards.last_output.tobytes()  # type: ignore[union-attr]
        assert [r.name for r in g.rules] == ["spike", "stuck", "plain"]
        assert g.rules[0].scale is not None and g.rules[0].scale.dtype == np.float64
        assert g.rules[0].scale.tobytes() == guards.rules[0].scale.tobytes()  # type: ignore[union-attr]
        assert g.rules[1].count is not None and g.rules[1].count.tolist() == [0, 3]
        assert g.rules[2].scale is None and g.rules[2].count is None
    empty = Checkpoint.decode(_with_guards(ckpt, GuardState()).encode()).guards
    assert empty == GuardState(None, None, ())


@pytest.mark.parametrize(
    ("guards", "words"),
    [
        (GuardState(np.array([np.nan] * 5, np.float32)), "guards input holds NaN"),
        (GuardState(None, None, (RuleState("r", np.array([np.nan])),)), "finite, > 0"),
        (GuardState(None, None, (RuleState("r", np.array([0.0])),)), "finite, > 0"),
        (GuardState(None, None, (RuleState("r", None, np.array([-1])),)), "counts must be"),
        (GuardState(None, None, (RuleState("r", None, np.array([1 << 20])),)), "counts must be"),
        (GuardState(None, None, (RuleState("", None, None),)), "name of 1 to 64"),
        (GuardState(None, None, (RuleState("r", np.zeros((2, 2)) + 1),)), "must be 1-D"),
    ],
)
def test_malformed_guard_state_is_a_layout_error(
    signal_model: MambaModel, guards: GuardState, words: str
) -> None:
    """Checkpoints are untrusted: a guard state with NaN where values must be finite, a
    scale that is not positive, counts out of range, a bad name or shape is refused."""
    ckpt, _inputs = make_checkpoint(signal_model)
    with pytest.raises(CheckpointLayoutError, match=words):
        Checkpoint.decode(_with_guards(ckpt, guards).encode())


def test_guard_state_of_another_shape_or_dtype_is_refused(signal_model: MambaModel) -> None:
    ckpt, _inputs = make_checkpoint(signal_model)
    wrong_input = _with_guards(ckpt, GuardState(np.zeros(4, np.float32)))
    with pytest.raises(CheckpointModelMismatchError, match="takes 5 values"):
        Checkpoint.decode(wrong_input.encode()).check_model(signal_model)
    wrong_output = _with_guards(ckpt, GuardState(None, np.zeros(7, np.float32)))
    with pytest.raises(CheckpointModelMismatchError, match="model outputs 3 values"):
        Checkpoint.decode(wrong_output.encode()).check_model(signal_model)
    blob = _with_guards(ckpt, GuardState(None, None, (RuleState("r", np.ones(2)),))).encode()
    header = header_of(blob)
    header["guards"]["rules"][0][1][0] = "<f4"  # a scale must be float64
    with pytest.raises(CheckpointLayoutError, match="scale has dtype '<f4'"):
        Checkpoint.decode(reseal(blob, header))
    header["guards"]["rules"] = "x"
    with pytest.raises(CheckpointLayoutError, match="rules has the wrong type"):
        Checkpoint.decode(reseal(blob, header))
