"""Mamba and Mamba-2 GGUF files, as llama.cpp's ``convert_hf_to_gguf.py`` writes them.

``ssmserve-server --model NAME=FILE.gguf`` (``loader.load_model`` comes here for a path
ending in ``.gguf``, or a file that starts with GGUF's magic). The file is read with
``gguf.GGUFReader``, llama.cpp's own Python reader of its format. What the converter
does to a Hugging Face ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` and how it is undone:

=====================================  =================================  ================
GGUF tensor (numpy order)               Hugging Face tensor                here
=====================================  =================================  ================
``token_embd.weight`` (v, d)            ``backbone.embeddings.weight``     as is
``output.weight`` (v, d)                ``lm_head.weight``                 absent: tied
``output_norm.weight`` (d,)             ``backbone.norm_f.weight``         as is
``blk.{l}.attn_norm.weight`` (d,)       ``backbone.layers.{l}.norm.weight``
``blk.{l}.ssm_in.weight``               ``mixer.in_proj.weight``           (``.bias`` too)
``blk.{l}.ssm_conv1d.weight`` (c, k)    ``mixer.conv1d.weight`` (c, 1, k)  squeezed: back
``blk.{l}.ssm_conv1d.bias``             ``mixer.conv1d.bias``              when present
``blk.{l}.ssm_x.weight``                ``mixer.x_proj.weight``            Mamba-1
``blk.{l}.ssm_dt.weight``               ``mixer.dt_proj.weight``           Mamba-1
``blk.{l}.ssm_dt.bias``                 ``dt_proj.bias`` / ``dt_bias``     Mamba-1 / 2
``blk.{l}.ssm_a`` (e, n) / (h, 1)       ``mixer.A_log`` (e, n) / (h,)      stored -exp(A_log)
``blk.{l}.ssm_d`` (e,) / (h, 1)         ``mixer.D``                        reshaped back
``blk.{l}.ssm_norm.weight`` (g, e/g)    ``mixer.norm.weight`` (e,)         Mamba-2; flattened
``blk.{l}.ssm_out.weight``              ``mixer.out_proj.weight``          (``.bias`` too)
=====================================  =================================  ================

The config comes from the metadata (``general.architecture`` ``mamba`` or ``mamba2``;
``{arch}.embedding_length``, ``.block_count``, ``.ssm.conv_kernel``, ``.ssm.inner_size``,
``.ssm.state_size``, ``.ssm.time_step_rank`` (Mamba-1's Δ rank; Mamba-2's head count),
``.ssm.group_count`` (Mamba-2), ``.attention.layer_norm_rms_epsilon``), the vocab size
from ``token_embd``'s rows, the biases from which tensors are there, and a tied head
from ``output.weight``'s absence. The epsilon is stored as a float32: it is read back as
the shortest decimal that rounds to it (``1e-05``, as ``config.json`` had it), since the
engine adds it in float64. A GGUF has no Mamba-2 ``time_step_limit``: the default
``(0, inf)``, as llama.cpp computes. FalconMamba's GGUF (``mamba`` with
``ssm.dt_b_c_rms``) is refused: it does not record the mixer norms' epsilon
(transformers' ``mixer_rms_eps``; llama.cpp uses the layer norms' instead).

**Tensor types.** F32 as is; F16 widened to float32 (exact); BF16 kept 16-bit for the
products' weights and the embedding table (``model_tensors.kept_16bit``), widened elsewhere;
Q8_0 kept as :class:`~ssmserve.server.engine.quantize.Q8Weight` for those same weights
(their int8 and float16 scales, exactly as stored) and dequantized to float32 elsewhere
(exact). The converter writes 1-D tensors, norms, ``ssm_conv1d`` and ``ssm_a`` in F32
whatever ``--outtype`` says, and F16 where Q8_0 does not apply (a row that is not whole
32-blocks: Mamba-1's ``dt_proj`` at a Δ rank of 48, for one). ``quantize="q8_0"``
quantises the products' F32 / F16 / BF16 weights as ``load_model`` does a directory's.
Any other type (Q4_K, ...) is refused, by tensor.

**Exactness.** Every tensor of an F32 GGUF has the bits of the directory it was
converted from, A excepted: the converter stores ``ssm_a = -torch.exp(A_log)``, while a
directory's A is ``-numpy.exp(A_log)``, and the two float32 exps differ (MKL's, which
torch calls on x86, against numpy's: by 1 or 2 ulp for about 4 values in 10, measured);
A_log cannot be recovered from A exactly (that would need torch's exp, bit for bit, on
the converting machine). So the engine computes with A as stored (``model_tensors._decay``), as
llama.cpp does: a GGUF gives the bits of the directory with A replaced by the GGUF's
(``tests/test_gguf.py``, steps at batch 1 and 8, prefill), and differs from the
directory itself only through those last bits of A. F16 / BF16 GGUFs are the directory
with the products and the embedding table rounded to F16 / BF16 (ties to even); a Q8_0
GGUF's quantised weights are ``quantize.quantize_q8_0``'s of the same values
(``gguf.quants`` is the reference both follow).

**Fingerprint.** A GGUF's fingerprint hashes its A where a directory's hashes A_log
(``model_tensors._fingerprint_of``), so it never equals the fingerprint of the directory it
came from, and a checkpoint of one is refused by the other: their outputs differ.

Loading is strict: an unreadable or cut-short file, an architecture other than these, a
metadata key missing or out of range, a missing, unexpected or misshapen tensor, an
unsupported tensor type, or a NaN or Inf is a
:class:`~ssmserve.server.errors.ModelFormatError` that names the file and what is wrong.
The memory check (``model_tensors.check_memory``) runs on the header, before any tensor data is
read.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ssmserve.server.engine.allocator import return_freed_memory, trim_own_arena
from ssmserve.server.engine.config import Architecture, MambaConfig
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.model_tensors import (
    build_model,
    check_memory,
    check_quantization,
    expected_shapes,
    kept_16bit,
)
from ssmserve.server.engine.numerics import widened
from ssmserve.server.engine.quantize import Q8Weight, from_blocks, quantizable, quantize_q8_0
from ssmserve.server.errors import ModelFormatError, clip

#: ``general.architecture`` values read here, and the model each is.
ARCHITECTURES = {"mamba": Architecture.LM, "mamba2": Architecture.MAMBA2_LM}
#: Tensor types read here (llama.cpp's names).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0")

_MAX_DIM = 1 << 20
_MAX_LAYERS = 4096


def read_gguf_config(path: str | os.PathLike[str]) -> MambaConfig:
    """The model a GGUF file holds, from its metadata and tensor shapes (no tensor data
    is read)."""
    path = Path(path)
    return _config(path, open_gguf(path))


def load_gguf(
    path: str | os.PathLike[str], name: str | None = None, quantize: str = "none"
) -> MambaModel:
    """Load and check a Mamba / Mamba-2 GGUF file (see the module docstring). ``name``
    defaults to the file's name less ``.gguf``; ``quantize`` as ``loader.load_model``."""
    path = Path(path)
    check_quantization(quantize)
    reader = open_gguf(path)
    config = _config(path, reader)
    model_name = name or path.name.removesuffix(path.suffix)
    tensors = _read_tensors(path, reader, config, model_name, quantize)
    del reader  # its map of the file
    model = build_model(config, tensors, name=model_name, consume=True)
    del tensors
    return_freed_memory()
    trim_own_arena()
    return model


# ------------------------------------------------------------------------------ reading


class _CutShort(Exception):
    pass


@functools.cache
def _reader_class() -> type:
    """``gguf.GGUFReader``, checking each tensor's bytes against the file's size and its
    type against the types GGUF knows before the reader maps them, so that a cut-short
    file is named as such (the reader alone fails on a numpy reshape)."""
    import gguf

    class Reader(gguf.GGUFReader):  # type: ignore[misc]
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            size = len(self.data)
            for field in fields:
                _len, name_data, _n_dims, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise ModelFormatError(
                        f"tensor {clip(name)} has type number {int(raw_dtype[0])}, which GGUF "
                        f"does not define; supported: {', '.join(SUPPORTED_TYPES)}"
                    ) from None
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                need = int(start_offs + int(offset[0]) + math.prod(int(x) for x in dims)
                           * type_size // block)  # fmt: skip
                if need > size:
                    raise _CutShort(
                        f"tensor {clip(name)} ends at byte {need:,} and the file has "
                        f"{size:,}: it is cut short (an interrupted download or copy?)"
                    )
            super()._build_tensors(start_offs, fields)

    return Reader


def open_gguf(path: Path) -> Any:
    """The file's ``GGUFReader`` (a map of it: nothing is read beyond the header)."""
    if not path.is_file():
        raise ModelFormatError(f"GGUF file {str(path)!r} does not exist")
    try:
        return _reader_class()(path, "r")
    except ModelFormatError as exc:
        raise ModelFormatError(f"{path.name}: {exc}") from None
    except _CutShort as exc:
        raise ModelFormatError(f"{path.name}: {exc}") from None
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError) as exc:
        size = path.stat().st_size
        raise ModelFormatError(
            f"{path.name}: not a readable GGUF file ({size:,} bytes: cut short or corrupt; "
            f"the reader says: {clip(str(exc))})"
        ) from None
    except OSError as exc:
        raise ModelFormatError(f"{path.name}: cannot read: {exc}") from None


def _field(reader: Any, key: str) -> Any:
    """A metadata value, or None where the key is missing."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _int(path: Path, reader: Any, key: str, maximum: int = _MAX_DIM) -> int:
    value = _field(reader, key)
    if value is None:
        raise ModelFormatError(f"{path.name}: metadata key {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ModelFormatError(
            f"{path.name}: metadata {key!r} must be an integer in 1..{maximum}, got {clip(value)}"
        )
    return value


def _epsilon(path: Path, reader: Any, key: str) -> float:
    value = _field(reader, key)
    if value is None:
        raise ModelFormatError(f"{path.name}: metadata key {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise ModelFormatError(
            f"{path.name}: metadata {key!r} must be a number in (0, 1), got {clip(value)}"
        )
    # Stored as a float32: the shortest decimal that rounds to it, as config.json had it.
    return float(str(np.float32(value)))


def _config(path: Path, reader: Any) -> MambaConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelFormatError(
            f"{path.name}: architecture {clip(arch)} is not served here; a GGUF must be "
            f"one of {', '.join(map(repr, ARCHITECTURES))} (llama.cpp's Mamba and Mamba-2)"
        )
    if _field(reader, f"{arch}.ssm.dt_b_c_rms"):
        raise ModelFormatError(
            f"{path.name}: a FalconMamba GGUF ({arch}.ssm.dt_b_c_rms) is not read: it does not "
            f"record the epsilon of the mixer's RMS norms (transformers' mixer_rms_eps); "
            f"serve the Hugging Face directory instead"
        )
    names = {t.name: t for t in reader.tensors}
    embd = names.get("token_embd.weight")
    if embd is None:
        raise ModelFormatError(f"{path.name}: tensor 'token_embd.weight' is missing")
    vocab = int(embd.shape[-1]) if len(embd.shape) == 2 else 0
    if not 1 <= vocab <= 1 << 24:
        raise ModelFormatError(
            f"{path.name}: tensor 'token_embd.weight' has shape {_ggml_shape(embd)} (GGUF "
            f"order); it must be [hidden, vocab]"
        )
    d = _int(path, reader, f"{arch}.embedding_length")
    e = _int(path, reader, f"{arch}.ssm.inner_size")
    n = _int(path, reader, f"{arch}.ssm.state_size")
    rank = _int(path, reader, f"{arch}.ssm.time_step_rank")
    common = dict(
        hidden_size=d,
        state_size=n,
        num_hidden_layers=_int(path, reader, f"{arch}.block_count", _MAX_LAYERS),
        intermediate_size=e,
        conv_kernel=_int(path, reader, f"{arch}.ssm.conv_kernel"),
        use_bias="blk.0.ssm_in.bias" in names,
        use_conv_bias="blk.0.ssm_conv1d.bias" in names,
        layer_norm_epsilon=_epsilon(path, reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        vocab_size=vocab,
        tie_word_embeddings="output.weight" not in names,
    )
    if ARCHITECTURES[arch] is Architecture.LM:
        return MambaConfig(architecture=Architecture.LM, time_step_rank=rank, **common)
    groups = _int(path, reader, f"{arch}.ssm.group_count")
    if e % rank or rank % groups:
        raise ModelFormatError(
            f"{path.name}: {arch}.ssm.inner_size ({e}) must be a multiple of the head count "
            f"{arch}.ssm.time_step_rank ({rank}), and that a multiple of "
            f"{arch}.ssm.group_count ({groups})"
        )
    return MambaConfig(
        architecture=Architecture.MAMBA2_LM,
        time_step_rank=0,
        num_heads=rank,
        head_dim=e // rank,
        n_groups=groups,
        **common,
    )


@dataclass(frozen=True)
class _Source:
    """Where a Hugging Face tensor is in the GGUF: its name there and its shape there
    (numpy order)."""

    name: str
    shape: tuple[int, ...]


def _sources(config: MambaConfig) -> dict[str, _Source]:
    """Each tensor ``expected_shapes(config)`` lists -> its GGUF name and stored shape."""
    out: dict[str, _Source] = {}
    for name, shape in expected_shapes(config).items():
        parts = name.split(".")
        if name == "backbone.embeddings.weight":
            gname = "token_embd.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        elif name == "backbone.norm_f.weight":
            gname = "output_norm.weight"
        elif parts[3] == "norm":  # backbone.layers.{l}.norm.weight
            gname = f"blk.{parts[2]}.attn_norm.weight"
        else:  # backbone.layers.{l}.mixer.{module}[.{leaf}]
            gname = f"blk.{parts[2]}." + _MIXER[".".join(parts[4:])]
        stored = shape
        if name.endswith("conv1d.weight"):  # (c, 1, k) squeezed
            stored = (shape[0], shape[2])
        elif config.mamba_version == 2 and parts[-1] in ("A_log", "D"):  # (h,) -> (h, 1)
            stored = (shape[0], 1)
        elif config.mamba_version == 2 and name.endswith("mixer.norm.weight"):  # per group
            stored = (config.n_groups, shape[0] // config.n_groups)
        out[name] = _Source(gname, stored)
    return out


_MIXER = {
    "in_proj.weight": "ssm_in.weight",
    "in_proj.bias": "ssm_in.bias",
    "conv1d.weight": "ssm_conv1d.weight",
    "conv1d.bias": "ssm_conv1d.bias",
    "x_proj.weight": "ssm_x.weight",
    "dt_proj.weight": "ssm_dt.weight",
    "dt_proj.bias": "ssm_dt.bias",
    "dt_bias": "ssm_dt.bias",
    "A_log": "ssm_a",
    "D": "ssm_d",
    "norm.weight": "ssm_norm.weight",
    "out_proj.weight": "ssm_out.weight",
    "out_proj.bias": "ssm_out.bias",
}


def _ggml_shape(tensor: Any) -> list[int]:
    return [int(x) for x in tensor.shape]


def _read_tensors(
    path: Path, reader: Any, config: MambaConfig, name: str, quantize: str
) -> dict[str, np.ndarray | Q8Weight]:
    """Every tensor the model needs, checked, keyed by its Hugging Face name (``…mixer.A``
    for the stored A in place of ``…mixer.A_log``); the memory check runs first."""
    sources = _sources(config)
    stored = {t.name: t for t in reader.tensors}
    wanted = {s.name for s in sources.values()}
    missing = sorted(wanted - set(stored))
    if missing:
        raise ModelFormatError(
            f"{path.name}: missing tensor(s) {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + f" for a {config.architecture} model with these metadata"
        )
    unexpected = sorted(set(stored) - wanted)
    if unexpected:
        raise ModelFormatError(
            f"{path.name}: unexpected tensor(s) {', '.join(map(clip, unexpected[:5]))} for a "
            f"{config.architecture} model with these metadata"
        )
    for src in sources.values():
        tensor = stored[src.name]
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ModelFormatError(
                f"{path.name}: tensor {src.name!r} is {kind}; supported: "
                f"{', '.join(SUPPORTED_TYPES)}"
            )
        shape = tuple(reversed(_ggml_shape(tensor)))
        if shape != src.shape:
            raise ModelFormatError(
                f"{path.name}: tensor {src.name!r} has shape {list(shape)} (GGUF order "
                f"{_ggml_shape(tensor)}); the metadata need {list(src.shape)}"
            )
    kinds = {hf: stored[src.name].tensor_type.name for hf, src in sources.items()}
    check_memory(config, name, kinds, True, quantize)  # before any tensor data is read
    tensors: dict[str, np.ndarray | Q8Weight] = {}
    shapes = expected_shapes(config)
    for hf_name, src in sources.items():
        value = _tensor(path, stored[src.name], hf_name, shapes[hf_name], quantize)
        if hf_name.endswith(".A_log"):  # the stored A = -exp(A_log): model_tensors._decay
            tensors[hf_name.removesuffix("_log")] = value
        else:
            tensors[hf_name] = value
    return tensors


def _tensor(
    path: Path, tensor: Any, hf_name: str, hf_shape: tuple[int, ...], quantize: str
) -> np.ndarray | Q8Weight:
    """One tensor's values in the engine's form (module docstring), at its Hugging Face
    shape ``hf_shape`` (the stored one, checked, undone: ``_sources``); a NaN or Inf is
    refused."""
    stored = tuple(reversed(_ggml_shape(tensor)))
    kind = tensor.tensor_type.name
    keep = kept_16bit(hf_name)  # a product's weight or the embedding table: 2-D
    value: np.ndarray | Q8Weight
    if kind == "Q8_0":  # whole 32-blocks a row, or the reader had refused it
        q8 = from_blocks(np.asarray(tensor.data), (math.prod(stored[:-1]), stored[-1]))
        if not np.isfinite(q8.scales).all():
            raise ModelFormatError(f"{path.name}: tensor {tensor.name!r} contains NaN or Inf")
        if keep and quantizable(hf_shape):
            return q8
        value = q8.dequantized()
    elif kind == "BF16":  # numpy has no bfloat16: the raw bits
        bits = np.array(tensor.data, copy=True).view("<u2").astype(np.uint16, copy=False)
        if ((bits & np.uint16(0x7F80)) == np.uint16(0x7F80)).any():
            raise ModelFormatError(f"{path.name}: tensor {tensor.name!r} contains NaN or Inf")
        value = bits if keep else widened(bits)
    elif kind == "F16" and keep:  # kept 16-bit: its bits, as int16 (``numerics.widened``)
        half = np.array(tensor.data, dtype=np.float16, copy=True)
        if not np.isfinite(half).all():
            raise ModelFormatError(f"{path.name}: tensor {tensor.name!r} contains NaN or Inf")
        value = half.view(np.int16)
    else:  # F32, or F16 (widened exactly)
        value = np.array(tensor.data, dtype=np.float32, copy=True)
        if not np.isfinite(value).all():
            raise ModelFormatError(f"{path.name}: tensor {tensor.name!r} contains NaN or Inf")
    value = value.reshape(hf_shape)
    if quantize == "q8_0" and keep and quantizable(hf_shape):
        try:
            return quantize_q8_0(value)
        except ValueError as exc:
            raise ModelFormatError(f"{path.name}: tensor {tensor.name!r}: {exc}") from None
    return value
