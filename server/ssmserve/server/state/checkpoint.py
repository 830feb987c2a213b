"""Checkpoint: an immutable, versioned, checksummed binary record of a session at step s.

Layout, format 2 (all integers little-endian)::

    offset  size  field
    0       8     magic  b"\\x89SSMCKP\\n"  (high bit and newline catch text-mode mangling)
    8       2     format version (u16) = 2
    10      2     flags (u16) = 0; any other value is refused
    12      4     header length H (u32), at most 16 MiB
    16      8     payload length P (u64)
    24      H     header: msgpack map (session, step, model, state, history, output, meta)
    24+H    pad   zeros up to S = the next multiple of 8 (the payload's arrays stay aligned)
    S       P     payload: raw little-endian arrays, each at a 64-byte offset from S
    S+P     16    xxh3_128 (canonical, big-endian) over bytes [0, S+P)

The header's ``state`` is ``{"layers": L, "conv": [c, k], "ssm": [e, n] | [h, p, n],
"array": ["<f4", [size], offset, nbytes]}``: the whole state as one packed float32 array,
layer by layer, conv then ssm (``SessionState.packed``'s layout), so encoding copies the
state's bytes once, into the blob, and decoding is one view (``SessionState.unpacked``).
``history`` is ``[first_step, dtype, shape, offset, nbytes]`` and the optional ``output``
(the guarded output of step s, float32 ``(o,)``, so a session restored at s can answer a
resend of s and start a forecast there without a replay) is ``[dtype, shape, offset,
nbytes]``. The optional ``guards`` (a session whose guard rules carry state from step to
step: ``sessions.stateful_guards``) is ``{"input": desc | None, "output": desc | None,
"rules": [[name, scale desc | None, count desc | None], ...]}``, each desc ``[dtype,
shape, offset, nbytes]``: the input applied at step s (float32 ``(i,)``, finite), its
output as answered (float32 ``(o,)``), and per stateful rule its running scale (float64,
finite, > 0) and its sustained counts (int64, 0 to 65,536). A checkpoint without it
(older, or of a session without such rules) still loads. The checksum is xxh3_128
(xxHash, ~27 GB/s here against sha256's ~1.4 GB/s): it detects damage, as sha256 did;
neither authenticates (anyone can recompute either), exports that must prove their
origin carry an HMAC (``checkpoint_signing``).

Format 1 (still read; ``encode(format_version=1)`` still writes it): the same prefix with
version 1, the header right after it with an ``arrays`` table of ``[name, dtype, shape,
offset, nbytes]`` per layer array (2-D, or 3-D for a Mamba-2's SSM state) instead of
``state``, the payload at 24+H, and a sha256 (32 bytes) at the end. A reader of format 1
only refuses a format-2 blob with a :class:`~ssmserve.server.errors.CheckpointVersionError`.

Decoding trusts nothing: lengths, checksum, every header field's type and range, dtypes
from a closed list, shape x itemsize = nbytes, arrays inside the payload and not
overlapping. Any failure is a typed :class:`~ssmserve.server.errors.CheckpointError`; no other
exception escapes (``tests/test_checkpoint_fuzz.py``). Arrays are decoded as read-only
``np.frombuffer`` views into the blob, so a 2.8 MiB state is not copied. No pickle.

Step numbering: step s is the state after s inputs. The input history holds the inputs
that produced steps ``first_step .. step`` (empty: ``first_step = step + 1``).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import xxhash

from ssmserve.server.engine.interface import Engine
from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.errors import (
    CheckpointChecksumError,
    CheckpointError,
    CheckpointLayoutError,
    CheckpointMagicError,
    CheckpointModelMismatchError,
    CheckpointTruncatedError,
    CheckpointVersionError,
    ModelInputError,
    clip,
)

MAGIC = b"\x89SSMCKP\n"
#: The format ``encode`` writes by default; ``READ_VERSIONS`` are the ones ``decode`` reads.
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
_PREFIX = struct.Struct("<8sHHIQ")  # magic, version, flags, header length, payload length
_DIGEST_SIZE = {1: 32, 2: 16}  # sha256, xxh3_128
_PAYLOAD_ALIGN = {1: 1, 2: 8}  # where the payload starts after the header
_ALIGN = 64
_MAX_HEADER = 16 << 20
_MAX_TEXT = 256
_MAX_TAGS = 64
_MAX_DIMS = 4

#: dtype codes allowed in a checkpoint: state arrays are float32; token history is int64.
STATE_DTYPE = "<f4"
HISTORY_DTYPES = ("<f4", "<i8")
SCALE_DTYPE = "<f8"
COUNT_DTYPE = "<i8"
_MAX_GUARD_RULES = 64
_MAX_GUARD_COUNT = 1 << 16


@dataclass(frozen=True)
class CheckpointMeta:
    created_at: float = field(default_factory=time.time)  # unix seconds
    reason: str = "manual"  # why it was taken: manual, periodic, close, migrate, ...
    label: str | None = None  # user label, unique per session by convention
    tags: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class InputHistory:
    """Inputs that produced steps ``first_step .. first_step + len(inputs) - 1``."""

    first_step: int
    inputs: np.ndarray  # (T,) int64 token ids or (T, i) float32 signal

    @property
    def last_step(self) -> int:
        return self.first_step + len(self.inputs) - 1


@dataclass(frozen=True)
class RuleState:
    """What one stateful guard rule carries from a step to the next."""

    name: str
    scale: np.ndarray | None = None  # (d,) float64, finite, > 0: a running scale
    count: np.ndarray | None = None  # (d,) int64 >= 0: consecutive broken steps


@dataclass(frozen=True)
class GuardState:
    """What a session's stateful guards carry from a step to the next (its meaning is
    ``sessions.stateful_guards``'); values, never changed in place."""

    last_input: np.ndarray | None = None  # (i,) float32: the input applied at the step
    last_output: np.ndarray | None = None  # (o,) float32: the step's output as answered
    rules: tuple[RuleState, ...] = ()


@dataclass(frozen=True)
class Checkpoint:
    session_id: str
    step: int
    model_id: str
    fingerprint: str
    state: SessionState
    history: InputHistory
    meta: CheckpointMeta = field(default_factory=CheckpointMeta)
    output: np.ndarray | None = None  # (o,) float32, the output of ``step``, if known
    guards: GuardState | None = None  # what its stateful guards carry, if it has any

    # ------------------------------------------------------------------ model checks

    def check_model(self, model: Engine) -> None:
        """Raise :class:`CheckpointModelMismatchError` unless this fits ``model`` exactly."""
        if self.fingerprint != model.fingerprint:
            raise CheckpointModelMismatchError(
                f"checkpoint of session {self.session_id!r} is for model {self.model_id!r} "
                f"(fingerprint {self.fingerprint[:16]}), not {model.name!r} "
                f"(fingerprint {model.fingerprint[:16]})"
            )
        try:
            model.check_state(self.state)
        except ModelInputError as exc:
            raise CheckpointModelMismatchError(f"checkpoint state does not fit: {exc}") from None
        c = model.config
        hist = self.history.inputs
        want = "int64 (T,)" if c.is_token_model else f"float32 (T, {c.input_dim})"
        ok = (
            (hist.dtype == np.int64 and hist.ndim == 1)
            if c.is_token_model
            else (hist.dtype == np.float32 and hist.ndim == 2 and hist.shape[1] == c.input_dim)
        )
        if not ok:
            raise CheckpointModelMismatchError(
                f"checkpoint input history is {hist.dtype}{list(hist.shape)}, model needs {want}"
            )
        if self.output is not None and self.output.shape != (c.output_dim,):
            raise CheckpointModelMismatchError(
                f"checkpoint output has shape {list(self.output.shape)}, model outputs "
                f"{c.output_dim} values"
            )
        g = self.guards
        if g is not None:
            if g.last_input is not None and (
                c.is_token_model or g.last_input.shape != (c.input_dim,)
            ):
                raise CheckpointModelMismatchError(
                    f"checkpoint guard state holds an input of shape {list(g.last_input.shape)}, "
                    f"model takes {'token ids' if c.is_token_model else c.input_dim} values"
                )
            if g.last_output is not None and g.last_output.shape != (c.output_dim,):
                raise CheckpointModelMismatchError(
                    f"checkpoint guard state holds an output of shape "
                    f"{list(g.last_output.shape)}, model outputs {c.output_dim} values"
                )

    # ------------------------------------------------------------------ encode

    def encode(self, format_version: int = FORMAT_VERSION) -> bytes:
        """Serialise; the arrays are copied once, into the returned bytes.

        ``format_version`` 1 writes what readers that predate format 2 read (a rolling
        upgrade's old workers; ``docs/deployment.md``).
        """
        if format_version not in READ_VERSIONS:
            raise CheckpointVersionError(f"cannot write checkpoint format {format_version}")
        _check_fields(self)
        payload = _PayloadWriter()
        fields: dict[str, Any] = {
            "session_id": self.session_id,
            "step": self.step,
            "model": {"id": self.model_id, "fingerprint": self.fingerprint},
        }
        if format_version == 1:
            fields["arrays"] = [
                [name, *payload.place(arr, STATE_DTYPE)] for name, arr in self.state.named_arrays()
            ]
        else:
            fields["state"] = _state_entry(self.state, payload)
        hist = self.history.inputs
        hist_dtype = "<i8" if np.issubdtype(hist.dtype, np.integer) else "<f4"
        fields["history"] = [self.history.first_step, *payload.place(hist, hist_dtype)]
        fields["meta"] = {
            "created_at": float(self.meta.created_at),
            "reason": self.meta.reason,
            "label": self.meta.label,
            "tags": dict(self.meta.tags),
        }
        if self.output is not None:
            fields["output"] = payload.place(self.output, STATE_DTYPE)
        if self.guards is not None:
            fields["guards"] = _guards_entry(self.guards, payload)
        header = msgpack.packb(fields, use_bin_type=True)
        prefix = _PREFIX.pack(MAGIC, format_version, 0, len(header), payload.size)
        pad = b"\0" * (-(len(prefix) + len(header)) % _PAYLOAD_ALIGN[format_version])
        digest = hashlib.sha256() if format_version == 1 else xxhash.xxh3_128()
        body = [prefix, header, pad, *payload.chunks]
        for chunk in body:
            digest.update(chunk)
        body.append(digest.digest())
        return b"".join(body)  # the one copy of the arrays

    # ------------------------------------------------------------------ decode

    @classmethod
    def decode(cls, blob: bytes | bytearray | memoryview) -> Checkpoint:
        """Parse and validate; raises only :class:`~ssmserve.server.errors.CheckpointError`s."""
        try:
            return _decode(memoryview(blob).cast("B") if not isinstance(blob, bytes) else blob)
        except CheckpointError:
            raise
        except Exception as exc:  # a validation gap must still surface as a typed error
            raise CheckpointLayoutError(f"checkpoint is malformed: {clip(repr(exc), 200)}") from exc


def _state_entry(state: SessionState, payload: _PayloadWriter) -> dict[str, Any]:
    """Format 2's ``state``: its arrays back to back, as ``SessionState.packed`` lays them
    out (a packed state is that already: one chunk to hash and copy)."""
    buffer = state.packed_buffer()
    if buffer is not None:
        arrays = [buffer]
    else:
        layers = state.layers
        if len({(la.conv.shape, la.ssm.shape) for la in layers}) != 1:
            raise CheckpointLayoutError("a state to encode needs layers, all of one shape")
        arrays = [a for layer in layers for a in (layer.conv, layer.ssm)]
    layout = state.layout
    return {
        "layers": layout.num_layers,
        "conv": list(layout.conv_shape),
        "ssm": list(layout.ssm_shape),
        "array": payload.place_all(arrays, STATE_DTYPE),
    }


def _guards_entry(g: GuardState, payload: _PayloadWriter) -> dict[str, Any]:
    def place(arr: np.ndarray | None, dtype: str) -> list[Any] | None:
        return None if arr is None else payload.place(arr, dtype)

    return {
        "input": place(g.last_input, STATE_DTYPE),
        "output": place(g.last_output, STATE_DTYPE),
        "rules": [
            [r.name, place(r.scale, SCALE_DTYPE), place(r.count, COUNT_DTYPE)] for r in g.rules
        ],
    }


def _guards(raw: Any, payload: _Payload) -> GuardState:
    """The ``guards`` entry read back: every array 1-D of its dtype, and in range."""
    g = _Fields(raw, "guards")

    def vector(what: str, desc: Any, dtype: str) -> np.ndarray | None:
        if desc is None:
            return None
        if not isinstance(desc, list):
            raise CheckpointLayoutError(f"guards {what} must be [dtype, shape, offset, nbytes]")
        arr = payload.array(f"guards {what}", desc, (dtype,))
        if arr.ndim != 1 or len(arr) > 1 << 20:
            raise CheckpointLayoutError(f"guards {what} must be 1-D, got shape {arr.shape}")
        return arr

    last_input = vector("input", g.get("input", (list, type(None))), STATE_DTYPE)
    if last_input is not None and not np.isfinite(last_input).all():
        raise CheckpointLayoutError("guards input holds NaN or Inf")
    last_output = vector("output", g.get("output", (list, type(None))), STATE_DTYPE)
    rules = g.get("rules", list)
    if len(rules) > _MAX_GUARD_RULES:
        raise CheckpointLayoutError(f"guards hold more than {_MAX_GUARD_RULES} rules")
    out = []
    for i, entry in enumerate(rules):
        if not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], str):
            raise CheckpointLayoutError(f"guards rules[{i}] must be [name, scale, count]")
        if not 1 <= len(entry[0]) <= 64:
            raise CheckpointLayoutError(f"guards rules[{i}] needs a name of 1 to 64 characters")
        scale = vector(f"rule {clip(entry[0])} scale", entry[1], SCALE_DTYPE)
        if scale is not None and not (np.isfinite(scale).all() and (scale > 0).all()):
            raise CheckpointLayoutError(f"guards rule {clip(entry[0])}: scales must be finite, > 0")
        count = vector(f"rule {clip(entry[0])} count", entry[2], COUNT_DTYPE)
        if count is not None and not ((count >= 0).all() and (count <= _MAX_GUARD_COUNT).all()):
            raise CheckpointLayoutError(
                f"guards rule {clip(entry[0])}: counts must be 0 to {_MAX_GUARD_COUNT}"
            )
        out.append(RuleState(entry[0], scale, count))
    return GuardState(last_input, last_output, tuple(out))


class _PayloadWriter:
    """The payload's chunks (views of the arrays, no copies) at 64-byte offsets."""

    def __init__(self) -> None:
        self.chunks: list[Any] = []
        self.size = 0

    def place_all(self, arrays: list[np.ndarray], dtype: str) -> list[Any]:
        """``arrays`` back to back as one 1-D array of ``dtype``; its table entry."""
        self._pad()
        start = self.size
        chunks = [np.ascontiguousarray(a, dtype=dtype) for a in arrays]  # no copies as a rule
        self.chunks += chunks
        self.size += sum(c.nbytes for c in chunks)
        nbytes = self.size - start
        return [dtype, [nbytes // np.dtype(dtype).itemsize], start, nbytes]

    def place(self, arr: np.ndarray, dtype: str) -> list[Any]:
        """``arr`` as ``dtype``; its table entry ``[dtype, shape, offset, nbytes]``."""
        data = np.ascontiguousarray(arr, dtype=dtype)
        self._pad()
        entry = [data.dtype.str, list(data.shape), self.size, data.nbytes]
        self.chunks.append(data.reshape(-1).view(np.uint8))  # raw bytes, no copy
        self.size += data.nbytes
        return entry

    def _pad(self) -> None:
        pad = -self.size % _ALIGN
        if pad:
            self.chunks.append(b"\0" * pad)
            self.size += pad


def _decode(blob: bytes | memoryview) -> Checkpoint:
    size = len(blob)
    head = bytes(blob[: _PREFIX.size])
    if head[: len(MAGIC)] != MAGIC[: min(len(head), len(MAGIC))]:
        raise CheckpointMagicError("not an ssmserve checkpoint (bad magic bytes)")
    if size < _PREFIX.size:
        raise CheckpointTruncatedError(f"checkpoint is truncated: only {size} bytes")
    _magic, version, flags, header_len, payload_len = _PREFIX.unpack(head)
    if version not in READ_VERSIONS:
        raise CheckpointVersionError(
            f"checkpoint format version {version} is not supported (this build reads "
            f"versions {', '.join(map(str, READ_VERSIONS))}); a newer ssmserve wrote it"
        )
    if flags != 0:
        raise CheckpointVersionError(f"checkpoint uses unknown feature flags {flags:#06x}")
    if header_len > _MAX_HEADER:
        raise CheckpointLayoutError(f"checkpoint header of {header_len} bytes is too large")
    header_end = _PREFIX.size + header_len
    payload_start = header_end + (-header_end % _PAYLOAD_ALIGN[version])
    digest_size = _DIGEST_SIZE[version]
    expected = payload_start + payload_len + digest_size
    if size != expected:
        what = "truncated" if size < expected else "followed by extra bytes"
        raise CheckpointTruncatedError(
            f"checkpoint is {what}: header says {expected} bytes, got {size}"
        )
    body_end = size - digest_size
    # memoryview: slicing bytes would copy the whole blob just to hash it
    body = memoryview(blob)[:body_end]
    digest = hashlib.sha256(body).digest() if version == 1 else xxhash.xxh3_128_digest(body)
    if digest != bytes(blob[body_end:]):
        raise CheckpointChecksumError("checkpoint checksum mismatch: the data is corrupted")

    try:
        header = msgpack.unpackb(
            blob[_PREFIX.size : header_end], raw=False, strict_map_key=True, use_list=True
        )
    except Exception as exc:
        raise CheckpointLayoutError(f"checkpoint header is not valid msgpack: {exc}") from None
    h = _Fields(header, "header")
    session_id = h.text("session_id", allow_empty=False)
    step = h.integer("step")
    model = _Fields(h.get("model", dict), "model")
    model_id = model.text("id")
    fp = model.text("fingerprint")
    meta = _meta(_Fields(h.get("meta", dict), "meta"))

    payload = _Payload(blob, payload_start, payload_len)
    state = _state_v1(h, payload) if version == 1 else _state_v2(h, payload)
    hist_raw = h.get("history", list)
    if len(hist_raw) != 5 or isinstance(hist_raw[0], bool) or not isinstance(hist_raw[0], int):
        raise CheckpointLayoutError("history must be [first_step, dtype, shape, offset, nbytes]")
    inputs = payload.array("history", hist_raw[1:], HISTORY_DTYPES)
    if inputs.ndim != (1 if inputs.dtype == np.int64 else 2):
        raise CheckpointLayoutError(f"history of dtype {inputs.dtype} has shape {inputs.shape}")
    history = InputHistory(hist_raw[0], inputs)
    output = None
    if "output" in header:
        output = payload.array("output", h.get("output", list), (STATE_DTYPE,))
        if output.ndim != 1:
            raise CheckpointLayoutError(f"output must be 1-D, got shape {output.shape}")
    guards = _guards(header["guards"], payload) if "guards" in header else None
    payload.check_disjoint()
    ckpt = Checkpoint(session_id, step, model_id, fp, state, history, meta, output, guards)
    _check_fields(ckpt, error=CheckpointLayoutError)
    return ckpt


def _meta(m: _Fields) -> CheckpointMeta:
    created_at = m.get("created_at", float)
    if not math.isfinite(created_at):
        raise CheckpointLayoutError("meta.created_at must be a finite number")
    tags = m.get("tags", dict)
    if len(tags) > _MAX_TAGS or not all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= _MAX_TEXT and len(v) <= _MAX_TEXT
        for k, v in tags.items()
    ):
        raise CheckpointLayoutError(f"meta.tags must map at most {_MAX_TAGS} short strings")
    label = m.get("label", (str, type(None)))
    if label is not None and len(label) > _MAX_TEXT:
        raise CheckpointLayoutError("meta.label is too long")
    return CheckpointMeta(created_at, m.text("reason"), label, tags)


def _state_v1(h: _Fields, payload: _Payload) -> SessionState:
    """Format 1's state: a table of per-layer arrays."""
    named: list[tuple[str, np.ndarray]] = []
    for i, entry in enumerate(h.get("arrays", list)):
        if not isinstance(entry, list) or len(entry) != 5 or not isinstance(entry[0], str):
            raise CheckpointLayoutError(f"arrays[{i}] must be [name, dtype, shape, offset, nbytes]")
        arr = payload.array(f"array {clip(entry[0])}", entry[1:], (STATE_DTYPE,))
        if arr.ndim not in (2, 3):
            raise CheckpointLayoutError(
                f"array {clip(entry[0])} must be 2-D or 3-D, got shape {arr.shape}"
            )
        named.append((entry[0], arr))
    try:
        state = SessionState.from_named_arrays(named)
    except ValueError as exc:
        raise CheckpointLayoutError(f"checkpoint state arrays: {exc}") from None
    layers = state.layers
    if not layers:
        raise CheckpointLayoutError("checkpoint holds no layers")
    _check_layer_shapes(layers[0].conv.shape, layers[0].ssm.shape)
    for i, layer in enumerate(layers):
        if layer.conv.shape != layers[0].conv.shape:
            raise CheckpointLayoutError(f"layer {i} conv state shape differs from layer 0")
        if layer.ssm.shape != layers[0].ssm.shape:
            raise CheckpointLayoutError(f"layer {i} ssm state shape differs from layer 0")
    return state


def _state_v2(h: _Fields, payload: _Payload) -> SessionState:
    """Format 2's state: one packed array and the shapes that cut it into layers."""
    s = _Fields(h.get("state", dict), "state")
    layers = s.integer("layers")
    conv, ssm = s.get("conv", list), s.get("ssm", list)
    for name, shape, dims in (("conv", conv, (2,)), ("ssm", ssm, (2, 3))):
        if len(shape) not in dims or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape
        ):
            raise CheckpointLayoutError(
                f"state.{name} must be {' or '.join(map(str, dims))} positive sizes, "
                f"got {clip(shape)}"
            )
    if layers < 1:
        raise CheckpointLayoutError("checkpoint holds no layers")
    _check_layer_shapes(tuple(conv), tuple(ssm))
    packed = payload.array("state", s.get("array", list), (STATE_DTYPE,))
    need = layers * (math.prod(conv) + math.prod(ssm))
    if packed.shape != (need,):
        raise CheckpointLayoutError(
            f"state of {layers} layers of conv {clip(conv)} and ssm {clip(ssm)} is "
            f"{need} floats, its array has shape {list(packed.shape)}"
        )
    return SessionState.unpacked(packed, layers, tuple(conv), tuple(ssm))


def _check_layer_shapes(conv: tuple[int, ...], ssm: tuple[int, ...]) -> None:
    """Mamba-1: conv (e, k), ssm (e, n); Mamba-2: conv (e + 2 g n, k), ssm (h, p, n).
    Which one, and the exact sizes, the model checks (``check_model``)."""
    if len(conv) != 2:
        raise CheckpointLayoutError("the conv state must be 2-D")
    if len(ssm) == 2 and conv[0] != ssm[0]:
        raise CheckpointLayoutError(
            f"state shapes disagree with each other: conv {list(conv)}, ssm {list(ssm)}"
        )


def _check_fields(ckpt: Checkpoint, error: type[CheckpointError] = CheckpointLayoutError) -> None:
    """Invariants that encode and decode both enforce."""
    if not 0 <= ckpt.step < 1 << 62:
        raise error(f"step {ckpt.step} is out of range")
    hist = ckpt.history
    if len(hist.inputs) and not (hist.first_step >= 1 and hist.last_step == ckpt.step):
        raise error(
            f"input history covers steps {hist.first_step}..{hist.last_step} "
            f"but the checkpoint is at step {ckpt.step}"
        )
    if not len(hist.inputs) and hist.first_step != ckpt.step + 1:
        raise error(f"empty input history must start at step {ckpt.step + 1}")
    for what, text in (("session_id", ckpt.session_id), ("model id", ckpt.model_id)):
        if len(text) > _MAX_TEXT:
            raise error(f"{what} is longer than {_MAX_TEXT} characters")


class _Fields:
    """Typed access to one msgpack map, raising CheckpointLayoutError on any mismatch."""

    def __init__(self, raw: Any, where: str) -> None:
        if not isinstance(raw, dict):
            raise CheckpointLayoutError(f"checkpoint {where} must be a map")
        self.raw, self.where = raw, where

    def get(self, key: str, kind: type | tuple[type, ...]) -> Any:
        if key not in self.raw:
            raise CheckpointLayoutError(f"checkpoint {self.where} lacks {clip(key)}")
        value = self.raw[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise CheckpointLayoutError(f"checkpoint {self.where}.{key} has the wrong type")
        return value

    def text(self, key: str, allow_empty: bool = True) -> str:
        value: str = self.get(key, str)
        if len(value) > _MAX_TEXT or (not allow_empty and not value):
            raise CheckpointLayoutError(f"checkpoint {self.where}.{key} is empty or too long")
        return value

    def integer(self, key: str) -> int:
        value: int = self.get(key, int)
        if value < 0:
            raise CheckpointLayoutError(f"checkpoint {self.where}.{key} is negative")
        return value


class _Payload:
    """Bounds-checked, zero-copy array views into the payload section."""

    def __init__(self, blob: bytes | memoryview, start: int, length: int) -> None:
        self.blob, self.start, self.length = blob, start, length
        self.spans: list[tuple[int, int, str]] = []

    def array(self, what: str, desc: list[Any], dtypes: tuple[str, ...]) -> np.ndarray:
        if len(desc) != 4:
            raise CheckpointLayoutError(f"{what} must be [dtype, shape, offset, nbytes]")
        dtype, shape, offset, nbytes = desc
        if dtype not in dtypes:
            raise CheckpointLayoutError(f"{what} has dtype {clip(dtype)}; allowed: {dtypes}")
        if (
            not isinstance(shape, list)
            or len(shape) > _MAX_DIMS
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
        ):
            raise CheckpointLayoutError(f"{what} has an invalid shape {clip(shape)}")
        for v in (offset, nbytes):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise CheckpointLayoutError(f"{what} has an invalid offset or size")
        itemsize = np.dtype(dtype).itemsize
        if math.prod(shape) * itemsize != nbytes:
            raise CheckpointLayoutError(
                f"{what}: shape {shape} of {dtype} needs {math.prod(shape) * itemsize} bytes, "
                f"table says {nbytes}"
            )
        if offset + nbytes > self.length:
            raise CheckpointLayoutError(f"{what} lies outside the payload")
        self.spans.append((offset, offset + nbytes, what))
        count = nbytes // itemsize
        arr = np.frombuffer(self.blob, dtype=dtype, count=count, offset=self.start + offset)
        return arr.reshape(shape)

    def check_disjoint(self) -> None:
        spans = sorted(s for s in self.spans if s[1] > s[0])
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            if start < end:
                raise CheckpointLayoutError(f"{a} and {b} overlap in the payload")
