"""Read and write model directories: ``config.json`` + ``model.safetensors`` (or shards
listed by ``model.safetensors.index.json``, as transformers writes big models).

Mamba-1 layouts (tensor names follow Hugging Face ``MambaForCausalLM``):

=============================================  ==============  ===========================
tensor                                          shape           when
=============================================  ==============  ===========================
``backbone.embeddings.weight``                  (v, d)          token models
``input_proj.weight`` / ``.bias``               (d, i) / (d,)   signal models
``backbone.layers.{l}.norm.weight``             (d,)
``backbone.layers.{l}.mixer.in_proj.weight``    (2e, d)         ``.bias`` (2e,) if use_bias
``backbone.layers.{l}.mixer.conv1d.weight``     (e, 1, k)       ``.bias`` (e,) if use_conv_bias
``backbone.layers.{l}.mixer.x_proj.weight``     (r + 2n, e)     never a bias
``backbone.layers.{l}.mixer.dt_proj.weight``    (e, r)          ``.bias`` (e,) always
``backbone.layers.{l}.mixer.A_log``             (e, n)
``backbone.layers.{l}.mixer.D``                 (e,)
``backbone.layers.{l}.mixer.out_proj.weight``   (d, e)          ``.bias`` (d,) if use_bias
``backbone.norm_f.weight``                      (d,)
``lm_head.weight``                              (v, d)          token models, unless tied
``output_head.weight`` / ``.bias``              (o, d) / (o,)   signal models
``input_norm.mean`` / ``.std``                  (i,) / (i,)     ``input_normalization``
``output_norm.mean`` / ``.std``                 (o,) / (o,)     ``output_normalization``
=============================================  ==============  ===========================

Mamba-2 (``Mamba2ForCausalLM``; c = e + 2 g n conv channels, h heads): the same
embeddings / input projection, norms and heads, and per layer

=============================================  ==============  ===========================
``backbone.layers.{l}.mixer.in_proj.weight``    (e + c + h, d)  ``.bias`` if use_bias
``backbone.layers.{l}.mixer.conv1d.weight``     (c, 1, k)       ``.bias`` (c,) if use_conv_bias
``backbone.layers.{l}.mixer.dt_bias``           (h,)
``backbone.layers.{l}.mixer.A_log``             (h,)
``backbone.layers.{l}.mixer.D``                 (h,)
``backbone.layers.{l}.mixer.norm.weight``       (e,)            the gated RMSNorm
``backbone.layers.{l}.mixer.out_proj.weight``   (d, e)          ``.bias`` (d,) if use_bias
=============================================  ==============  ===========================

(``backbone.embedding.weight``, as checkpoints converted from mamba_ssm name it, is read
as ``backbone.embeddings.weight``, as transformers does.)

Loading is strict: a missing, unexpected, misshapen, non-float or non-finite tensor is a
:class:`~ssmserve.server.errors.ModelFormatError` that names it. Weights stored in F32, F16,
BF16 or F64 load exactly into float32 (F16 widens exactly; BF16 is the top half of a
float32, so a 16-bit shift; F64 rounds to nearest) and the engine computes in float32;
``load_model`` keeps the products' weights and the embedding table stored as BF16 or F16
at 16 bits (their bits as uint16 / int16 arrays) and the kernel widens them as it loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ssmserve.client.atomic_file import atomic_write
from ssmserve.server.engine.allocator import return_freed_memory, trim_own_arena
from ssmserve.server.engine.config import MambaConfig
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.model_tensors import (
    build_model,
    check_memory,
    check_quantization,
    expected_shapes,
    fingerprint_start,
    kept_16bit,
)
from ssmserve.server.engine.numerics import widened
from ssmserve.server.engine.quantize import Q8Weight, quantizable, quantize_q8_0
from ssmserve.server.errors import ModelFormatError, clip

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_FLOAT_DTYPES = {"BF16", "F16", "F32", "F64"}
_MAX_SHARDS = 1024


def load_model(
    directory: str | os.PathLike[str], name: str | None = None, quantize: str = "none"
) -> MambaModel:
    """Load and validate a model directory, or a GGUF file (``gguf_model``). ``name``
    defaults to the directory's name (a GGUF's file name less ``.gguf``). ``quantize``:
    ``"none"`` (each weight at its stored precision: BF16 stays 16-bit, the rest float32)
    or ``"q8_0"`` (the products' weights and the embedding table in llama.cpp's Q8_0, as
    each is read: ``quantize.py``)."""
    path = Path(directory)
    if is_gguf(path):
        from ssmserve.server.engine.gguf_model import load_gguf

        return load_gguf(path, name, quantize)
    check_quantization(quantize)
    config = read_config(path)
    tensors = read_weights(path, config, keep_bf16=True, quantize=quantize)
    model = build_model(config, tensors, name=name or path.resolve().name, consume=True)
    del tensors
    # The read copies are freed now, but the heap keeps freed pages for the steps
    # (``allocator``): give them back, so a loaded model holds about its weights' bytes.
    return_freed_memory()
    trim_own_arena()
    return model


def read_config(directory: Path) -> MambaConfig:
    """A model directory's ``config.json``, or a GGUF file's metadata (``gguf_model``)."""
    if is_gguf(directory):
        from ssmserve.server.engine.gguf_model import read_gguf_config

        return read_gguf_config(directory)
    if not directory.is_dir():
        raise ModelFormatError(f"model directory {str(directory)!r} does not exist")
    cfg_path = directory / CONFIG_FILE
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFormatError(f"{str(cfg_path)!r} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{str(cfg_path)!r} is not valid JSON: {exc}") from None
    return MambaConfig.from_json(raw)


def is_gguf(path: Path) -> bool:
    """Whether ``path`` names a GGUF file rather than a model directory: its name ends in
    ``.gguf`` (and it is no directory), or it is a file that starts with GGUF's magic."""
    if path.is_dir():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with contextlib.suppress(OSError), path.open("rb") as fh:
        return fh.read(4) == b"GGUF"
    return False


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model: ``model.safetensors``, or the shards that
    ``model.safetensors.index.json`` names (file names in the directory, nothing else)."""
    single = directory / WEIGHTS_FILE
    if single.is_file():
        return [single]
    index = directory / INDEX_FILE
    if not index.is_file():
        raise ModelFormatError(f"{str(directory)!r} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{INDEX_FILE} is not valid JSON: {clip(str(exc))}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFormatError(f"{INDEX_FILE}: 'weight_map' must map tensor names to files")
    names = set(weight_map.values())
    for name in names:
        if (
            not isinstance(name, str)
            or not name.endswith(".safetensors")
            or Path(name).name != name
            or name.startswith(".")
        ):
            raise ModelFormatError(
                f"{INDEX_FILE}: shard {clip(str(name))} must be a .safetensors file name in "
                f"the model directory"
            )
    if len(names) > _MAX_SHARDS:
        raise ModelFormatError(f"{INDEX_FILE}: {len(names)} shards, at most {_MAX_SHARDS}")
    return [directory / name for name in sorted(names)]


def read_weights(
    directory: Path, config: MambaConfig, keep_bf16: bool = False, quantize: str = "none"
) -> dict[str, np.ndarray | Q8Weight]:
    """Read the tensors ``config`` needs from the model's safetensors file(s), checked and
    as float32; a model that would not fit in the available memory is refused first.

    ``keep_bf16``: the weights of the products and the embedding table
    (:func:`kept_16bit`) stored as BF16 or F16 stay 16-bit, as uint16 (BF16) or int16
    (F16) arrays of their bits (``numerics.widened`` gives their float32 values);
    everything else is float32.
    ``quantize="q8_0"``: those weights whose rows are whole 32-blocks become
    :class:`~ssmserve.server.engine.quantize.Q8Weight` as each is read, so the model is
    never held at its stored width in full."""
    check_quantization(quantize)
    check_memory(config, directory.name, None, keep_bf16, quantize)  # the least: no I/O
    want = expected_shapes(config)
    files = weight_files(directory)
    where: dict[str, Path] = {}  # stored name -> its file
    dtypes: dict[str, str] = {}  # stored name -> its dtype
    for path in files:
        if not path.is_file():
            raise ModelFormatError(f"shard {path.name!r} is missing")
        for stored, dtype in _keys(path).items():
            if stored in where:
                raise ModelFormatError(
                    f"tensor {clip(stored)} is stored twice ({where[stored].name}, {path.name})"
                )
            where[stored], dtypes[stored] = path, dtype
    # Checkpoints converted from mamba_ssm say "embedding", transformers "embeddings".
    names = {_ALIASES.get(stored, stored): stored for stored in where}
    # A tied LM head stored anyway is ignored, as transformers does.
    tolerated = {"lm_head.weight"} if config.is_token_model else set()
    missing = sorted(set(want) - set(names))
    unexpected = sorted(set(names) - set(want) - tolerated)
    if missing:
        raise ModelFormatError(
            f"missing tensor(s) {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + f" for a {config.architecture} model with this config"
        )
    if unexpected:
        raise ModelFormatError(
            f"unexpected tensor(s) {', '.join(unexpected[:5])} "
            f"for a {config.architecture} model with this config"
        )
    stored_dtypes = {name: dtypes[stored] for name, stored in names.items()}
    check_memory(config, directory.name, stored_dtypes, keep_bf16, quantize)  # as stored
    tensors: dict[str, np.ndarray | Q8Weight] = {}
    keep = frozenset(n for n in want if kept_16bit(n)) if keep_bf16 else frozenset()
    q8 = (
        frozenset(n for n in want if kept_16bit(n) and quantizable(want[n]))
        if quantize == "q8_0"
        else frozenset()
    )
    for path in files:
        mine = {name: shape for name, shape in want.items() if where[names[name]] == path}
        wanted = {names[n]: (n, shape) for n, shape in mine.items()}
        tensors.update(_read_file(path, wanted, keep, q8))
    return tensors


_ALIASES = {"backbone.embedding.weight": "backbone.embeddings.weight"}


def _keys(path: Path) -> dict[str, str]:
    """Each tensor of a safetensors file with its dtype, from its header."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            return {key: f.get_slice(key).get_dtype() for key in f.keys()}  # noqa: SIM118
    except SafetensorError as exc:
        raise ModelFormatError(f"{path.name}: not a valid safetensors file: {exc}") from None
    except OSError as exc:
        raise ModelFormatError(f"{path.name}: cannot read: {exc}") from None


def _read_file(
    path: Path,
    wanted: dict[str, tuple[str, tuple[int, ...]]],
    keep: frozenset[str],
    q8: frozenset[str] = frozenset(),
) -> dict[str, np.ndarray | Q8Weight]:
    """``wanted``: stored name -> (name, shape). Returns name -> float32 array, the
    uint16 bits of a BF16 tensor whose name is in ``keep``, or the Q8_0 form of one whose
    name is in ``q8``."""
    tensors: dict[str, np.ndarray | Q8Weight] = {}
    try:
        with safe_open(str(path), framework="numpy") as f:
            for stored, (name, shape) in wanted.items():
                part = f.get_slice(stored)
                dtype = part.get_dtype()
                if dtype not in _FLOAT_DTYPES:
                    raise ModelFormatError(
                        f"{path.name}: tensor {stored!r} has dtype {dtype}; "
                        f"supported: {', '.join(sorted(_FLOAT_DTYPES))}"
                    )
                stored_shape = tuple(part.get_shape())
                if stored_shape != shape:
                    raise ModelFormatError(
                        f"{path.name}: tensor {stored!r} has shape {list(stored_shape)}, "
                        f"config needs {list(shape)}"
                    )
                if dtype == "BF16":  # numpy has no bfloat16: its raw bits
                    bits = _bf16_bits(path, stored, shape)
                    finite = not ((bits & np.uint16(0x7F80)) == np.uint16(0x7F80)).any()
                    arr = bits if name in keep else widened(bits)
                elif dtype == "F16" and name in keep:  # its bits, as int16 (``widened``)
                    half = np.ascontiguousarray(f.get_tensor(stored), dtype=np.float16)
                    finite = bool(np.isfinite(half).all())
                    arr = half.view(np.int16)
                else:
                    arr = np.ascontiguousarray(f.get_tensor(stored), dtype=np.float32)
                    finite = bool(np.isfinite(arr).all())
                if not finite:
                    raise ModelFormatError(f"{path.name}: tensor {stored!r} contains NaN or Inf")
                tensors[name] = _quantized(path, stored, arr) if name in q8 else arr
    except SafetensorError as exc:
        raise ModelFormatError(f"{path.name}: not a valid safetensors file: {exc}") from None
    except OSError as exc:
        raise ModelFormatError(f"{path.name}: cannot read: {exc}") from None
    return tensors


def _quantized(path: Path, stored: str, arr: np.ndarray) -> Q8Weight:
    """``arr`` (float32, or bfloat16 bits) in Q8_0; a value too big for it is named."""
    try:
        return quantize_q8_0(arr)
    except ValueError as exc:
        raise ModelFormatError(f"{path.name}: tensor {stored!r}: {exc}") from None


def _bf16_bits(path: Path, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A BF16 tensor's raw bits (uint16, ``shape``): bfloat16 is the high 16 bits of a
    float32, so ``numerics.widened`` gives its values exactly.

    The file was opened and checked by safetensors already (header, offsets in range);
    here only this tensor's offsets are read from its header to reach the raw bytes.
    """
    count = math.prod(shape)
    with path.open("rb") as fh:
        try:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            begin, end = json.loads(fh.read(header_len))[name]["data_offsets"]
        except (struct.error, ValueError, KeyError, TypeError):  # changed since it was checked
            raise ModelFormatError(f"{path.name}: cannot read tensor {name!r}'s header") from None
        if end - begin != 2 * count:
            raise ModelFormatError(f"{path.name}: tensor {name!r} has {end - begin} bytes")
        fh.seek(8 + header_len + begin)
        bits = np.fromfile(fh, dtype="<u2", count=count)  # one copy: the array itself
    if bits.size != count:
        raise ModelFormatError(f"{path.name}: tensor {name!r} is cut short")
    return bits.astype(np.uint16, copy=False).reshape(shape)


def save_model(
    directory: str | os.PathLike[str],
    config: MambaConfig,
    tensors: dict[str, np.ndarray],
    dtype: str = "F32",
) -> None:
    """Write ``config.json`` + ``model.safetensors`` (each atomically) into ``directory``.

    ``tensors``: float32 values (uint16 arrays are BF16 bits, as ``read_weights`` keeps
    them: widened). ``dtype``: ``"F32"``, or ``"BF16"`` (each value rounded to the nearest
    bfloat16, ties to even, as torch rounds; numpy has no bfloat16, so the file is written
    here, in the safetensors layout: :func:`save_model_streamed`)."""
    want = expected_shapes(config)
    if set(want) != set(tensors):
        raise ModelFormatError(
            f"tensors do not match the config: {sorted(set(want) ^ set(tensors))}"
        )
    if dtype not in _SAVED_DTYPES:
        raise ValueError(f"dtype must be 'F32' or 'BF16', got {dtype!r}")
    if dtype == "BF16":
        save_model_streamed(directory, config, lambda name, _shape: tensors[name], dtype)
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.ascontiguousarray(widened(v), dtype=np.float32) for k, v in tensors.items()}
    atomic_write(path / WEIGHTS_FILE, lambda tmp: save_file(arrays, tmp, metadata={"format": "np"}))
    _save_config(path, config)


#: A model's tensors one at a time: ``source(name, shape)`` gives that tensor's values,
#: float32 (or a uint16 array: the bits of BF16 values).
TensorSource = Callable[[str, tuple[int, ...]], np.ndarray]

#: Bytes a value as ``save_model`` / ``save_model_streamed`` store it.
_SAVED_DTYPES = {"F32": 4, "BF16": 2}
#: Values rounded, written and hashed at a time: a tensor's stored copy is never whole.
_WRITE_CHUNK_VALUES = 1 << 22


def save_model_streamed(
    directory: str | os.PathLike[str],
    config: MambaConfig,
    source: TensorSource,
    dtype: str = "BF16",
) -> str:
    """Write ``config.json`` + ``model.safetensors`` (each atomically) into ``directory``
    one tensor at a time, so a model far bigger than memory can be written: ``source`` is
    called once per tensor, in name order (the file's order), and its array is written, a
    chunk at a time, and let go before the next is asked for. Memory holds the largest
    tensor as ``source`` gives it and a few MiB, never the model. ``dtype``: ``"BF16"``
    (values rounded to the nearest bfloat16, ties to even, as torch rounds; BF16 bits are
    written as they are) or ``"F32"``. Returns the model's fingerprint (what
    :func:`load_model` will give it), hashed from the values as written."""
    if dtype not in _SAVED_DTYPES:
        raise ValueError(f"dtype must be 'F32' or 'BF16', got {dtype!r}")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    shapes = expected_shapes(config)
    h = fingerprint_start(config)

    def write(tmp: str) -> None:
        with Path(tmp).open("wb") as fh:
            fh.write(_safetensors_header(shapes, dtype))
            for name in sorted(shapes):
                values = source(name, shapes[name])
                if tuple(values.shape) != shapes[name]:
                    raise ModelFormatError(
                        f"tensor {name}: shape {list(values.shape)}, config needs "
                        f"{list(shapes[name])}"
                    )
                _write_tensor(fh, h, name, values, dtype)
                del values  # before the next tensor is made

    atomic_write(path / WEIGHTS_FILE, write)
    _save_config(path, config)
    return h.hexdigest()


def weights_file_bytes(config: MambaConfig, dtype: str = "BF16") -> int:
    """The size of the ``model.safetensors`` that :func:`save_model_streamed` writes."""
    shapes = expected_shapes(config)
    data = sum(math.prod(s) for s in shapes.values()) * _SAVED_DTYPES[dtype]
    return len(_safetensors_header(shapes, dtype)) + data


def _save_config(path: Path, config: MambaConfig) -> None:
    text = json.dumps(config.to_json(), indent=2, sort_keys=True) + "\n"
    atomic_write(path / CONFIG_FILE, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values -> the bits of the nearest bfloat16 (ties to even), uint16."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def _safetensors_header(shapes: Mapping[str, tuple[int, ...]], dtype: str) -> bytes:
    """The head of a safetensors file of tensors ``shapes`` stored as ``dtype``, in name
    order: an 8-byte length, then the JSON header padded to 8 bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(shapes):
        size = _SAVED_DTYPES[dtype] * math.prod(shapes[name])
        header[name] = {
            "dtype": dtype,
            "shape": list(shapes[name]),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_tensor(
    fh: BinaryIO, h: hashlib._Hash, name: str, values: np.ndarray, dtype: str
) -> None:
    """``values`` (float32, or uint16 BF16 bits) as ``dtype`` into ``fh`` and into the
    fingerprint ``h``, a chunk of rows at a time."""
    h.update(f"\0{name}\0{tuple(values.shape)}\0".encode())
    flat = values.reshape(-1)
    for v0 in range(0, flat.size, _WRITE_CHUNK_VALUES):
        part = flat[v0 : v0 + _WRITE_CHUNK_VALUES]
        if dtype == "BF16":
            bits = part if part.dtype == np.uint16 else bf16_bits(part)
            stored = np.ascontiguousarray(bits, dtype="<u2")
            wide = np.ascontiguousarray(widened(bits), dtype="<f4")
        else:
            stored = wide = np.ascontiguousarray(widened(part), dtype="<f4")
        fh.write(memoryview(stored).cast("B"))
        h.update(memoryview(wide).cast("B"))
