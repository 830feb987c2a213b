"""A model's tensors whatever file holds them: which tensors a config needs and their
shapes (:func:`expected_shapes`), which may stay 16-bit in memory, the fingerprint, the
memory a load takes (refused before it is read when it does not fit), and the model
assembled from checked tensors (:func:`build_model`).

Both file formats load through it: model directories (``loader``) and GGUF files
(``gguf_model``), so it lives below both, and ``loader`` (which hands a GGUF path to
``gguf_model``) imports it rather than the other way round. The tensors' names and shapes
are tabled in ``loader``'s docstring.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping

import numpy as np

from ssmserve.server.engine.allocator import keep_freed_pages
from ssmserve.server.engine.config import MambaConfig
from ssmserve.server.engine.machine_memory import available_memory
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.mamba1 import MambaBlockWeights
from ssmserve.server.engine.mamba2 import Mamba2BlockWeights
from ssmserve.server.engine.numerics import RowStableLinear, pin_blas_threads, widened
from ssmserve.server.engine.quantize import (
    QUANTIZATIONS,
    QUANTIZE_TRANSIENT_BYTES,
    Q8Weight,
    quantizable,
)
from ssmserve.server.engine.weights import BlockWeights, ChannelScaling
from ssmserve.server.errors import InsufficientMemoryError, ModelFormatError


def expected_shapes(config: MambaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model directory must hold, with its shape."""
    c = config
    d, e, n, k, r = (
        c.hidden_size,
        c.intermediate_size,
        c.state_size,
        c.conv_kernel,
        c.time_step_rank,
    )
    shapes: dict[str, tuple[int, ...]] = {}
    if c.is_token_model:
        shapes["backbone.embeddings.weight"] = (c.vocab_size, d)
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, d)
    else:
        shapes["input_proj.weight"] = (d, c.input_dim)
        shapes["input_proj.bias"] = (d,)
        shapes["output_head.weight"] = (c.output_dim, d)
        shapes["output_head.bias"] = (c.output_dim,)
        if c.input_normalization:
            shapes["input_norm.mean"] = (c.input_dim,)
            shapes["input_norm.std"] = (c.input_dim,)
        if c.output_normalization:
            shapes["output_norm.mean"] = (c.output_dim,)
            shapes["output_norm.std"] = (c.output_dim,)
    for layer in range(c.num_hidden_layers):
        p = f"backbone.layers.{layer}."
        shapes[p + "norm.weight"] = (d,)
        if c.mamba_version == 2:
            shapes.update(_mamba2_layer_shapes(c, p + "mixer."))
            continue
        shapes[p + "mixer.in_proj.weight"] = (2 * e, d)
        shapes[p + "mixer.conv1d.weight"] = (e, 1, k)
        shapes[p + "mixer.x_proj.weight"] = (r + 2 * n, e)
        shapes[p + "mixer.dt_proj.weight"] = (e, r)
        shapes[p + "mixer.dt_proj.bias"] = (e,)
        shapes[p + "mixer.A_log"] = (e, n)
        shapes[p + "mixer.D"] = (e,)
        shapes[p + "mixer.out_proj.weight"] = (d, e)
        if c.use_bias:
            shapes[p + "mixer.in_proj.bias"] = (2 * e,)
            shapes[p + "mixer.out_proj.bias"] = (d,)
        if c.use_conv_bias:
            shapes[p + "mixer.conv1d.bias"] = (e,)
    shapes["backbone.norm_f.weight"] = (d,)
    return shapes


def _mamba2_layer_shapes(c: MambaConfig, p: str) -> dict[str, tuple[int, ...]]:
    d, e, h, k, conv = c.hidden_size, c.intermediate_size, c.num_heads, c.conv_kernel, c.conv_dim
    shapes: dict[str, tuple[int, ...]] = {
        p + "in_proj.weight": (e + conv + h, d),
        p + "conv1d.weight": (conv, 1, k),
        p + "dt_bias": (h,),
        p + "A_log": (h,),
        p + "D": (h,),
        p + "norm.weight": (e,),
        p + "out_proj.weight": (d, e),
    }
    if c.use_bias:
        shapes[p + "in_proj.bias"] = (e + conv + h,)
        shapes[p + "out_proj.bias"] = (d,)
    if c.use_conv_bias:
        shapes[p + "conv1d.bias"] = (conv,)
    return shapes


#: Values widened at a time while hashing: a 16-bit or Q8_0 weight is never widened whole.
_HASH_CHUNK_VALUES = 1 << 20


def fingerprint(config: MambaConfig, tensors: Mapping[str, np.ndarray | Q8Weight]) -> str:
    """sha256 over the canonical config and every tensor (name, shape, float32 bytes). A
    Q8_0 weight's entry also names its format: a quantised model is never taken for a
    float32 one (a checkpoint of one is refused by the other), even where the values
    agree. BF16 kept 16-bit is not named: its values and every output are the F32 copy's."""
    h = fingerprint_start(config)
    for name in sorted(expected_shapes(config)):
        _fingerprint_add(h, name, tensors[name])
    return h.hexdigest()


def fingerprint_start(config: MambaConfig) -> hashlib._Hash:
    """The fingerprint's hash with the config in it; each tensor follows, in name order
    (:func:`_fingerprint_add`): :func:`fingerprint` whole, ``loader.save_model_streamed``
    as it writes."""
    h = hashlib.sha256()
    h.update(b"ssmserve-model-v1\0")
    h.update(json.dumps(config.canonical(), sort_keys=True).encode())
    return h


def _fingerprint_add(h: hashlib._Hash, name: str, tensor: np.ndarray | Q8Weight) -> None:
    tag = "\0q8_0" if isinstance(tensor, Q8Weight) else ""
    h.update(f"\0{name}{tag}\0{tuple(tensor.shape)}\0".encode())
    rows = max(1, _HASH_CHUNK_VALUES // max(1, math.prod(tensor.shape[1:])))
    for r0 in range(0, max(1, tensor.shape[0]), rows):  # widened a chunk at a time
        part = np.ascontiguousarray(widened(tensor[r0 : r0 + rows]), dtype="<f4")
        h.update(memoryview(part).cast("B"))


#: What a load takes beyond the arrays :func:`load_bytes` counts (the heap's fragments,
#: the reads' buffers, the workspaces and kernels of the warm-up that follows): a worker
#: loading the mamba-2.8b preset in BF16 peaked 0.9 GiB (15%) above the arrays' 5.9 GiB
#: (``bench/bench_big_model.py``, docs/benchmark-history.md).
LOAD_HEADROOM = 1.15


def check_quantization(quantize: str) -> None:
    """``ValueError`` naming the formats for a ``quantize`` the engine has not."""
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZATIONS)}, got {quantize!r}")


def load_bytes(
    config: MambaConfig,
    stored: Mapping[str, str] | None = None,
    keep_bf16: bool = False,
    quantize: str = "none",
) -> int:
    """Memory a load of ``config``'s model takes at its peak: each tensor at its width in
    memory (2 bytes a value for a BF16 weight kept 16-bit, else 4), and three times the
    largest tensor on top: packing a weight into panels holds a padded copy and the panels
    beside the tensor read (:func:`build_model` lets each read tensor go once packed), and
    a margin for the panels' padding and the rest (measured: 2.1x the largest above the
    total). ``stored``: each tensor's stored dtype; None (not read yet): every tensor that
    may stay 16-bit counts as BF16, the least the load can take; a product weight stored
    ``"Q8_0"`` (a GGUF's) is held as Q8_0, its copies counted at 4 bytes a value (the
    fingerprint widens it a chunk at a time). ``quantize="q8_0"``: each
    weight that becomes Q8_0 counts 1.125 bytes a value (its int8 and its scales, widened
    to float32), the three copies count at the width read, and quantising takes a fixed
    few MiB more (``quantize.QUANTIZE_TRANSIENT_BYTES``). All of it times
    :data:`LOAD_HEADROOM`, for what a load takes beyond its arrays. ``tests/test_bf16_weights.py``
    and ``tests/test_q8_weights.py`` hold it against tracemalloc's peak."""
    sizes, read = [], []  # bytes held once loaded; bytes of the copy read
    for name, shape in expected_shapes(config).items():
        kind = "BF16" if stored is None else stored.get(name)
        values = math.prod(shape)
        q8 = kept_16bit(name) and quantizable(shape) and (quantize == "q8_0" or kind == "Q8_0")
        half = keep_bf16 and kept_16bit(name) and kind in ("BF16", "F16")
        read.append(values * (2 if half else 4))
        sizes.append(values * 9 // 8 if q8 else read[-1])
    transient = QUANTIZE_TRANSIENT_BYTES if quantize == "q8_0" else 0
    return int((sum(sizes) + 3 * max(read) + transient) * LOAD_HEADROOM)


def check_memory(
    config: MambaConfig,
    name: str,
    stored: Mapping[str, str] | None = None,
    keep_bf16: bool = False,
    quantize: str = "none",
) -> None:
    """Refuse (:class:`InsufficientMemoryError`, naming the figures) a model whose load would
    need more memory than is available (:func:`load_bytes`), before its data is read."""
    need, have = load_bytes(config, stored, keep_bf16, quantize), available_memory()
    if have is not None and need > have:
        params = sum(math.prod(s) for s in expected_shapes(config).values())
        raise InsufficientMemoryError(
            f"model {name!r} needs about {need / 2**30:.1f} GiB of memory to load "
            f"({params:,} parameters, its largest tensor thrice while it is packed) and "
            f"{have / 2**30:.1f} GiB is available here: free memory, or serve it on a "
            f"machine with more"
        )


def kept_16bit(name: str) -> bool:
    """Whether a tensor may stay at its stored 16 bits in memory: the weight of a product
    (RowStableLinear, whose kernel widens it as it loads) or the embedding table (whose
    looked-up rows are widened). Together they are all but ~1% of a model's bytes."""
    return name == "backbone.embeddings.weight" or (
        name.endswith(".weight") and name.rsplit(".", 2)[-2] in _PRODUCTS
    )


_PRODUCTS = frozenset(
    {"in_proj", "x_proj", "dt_proj", "out_proj", "lm_head", "input_proj", "output_head"}
)


def build_model(
    config: MambaConfig, tensors: dict[str, np.ndarray], name: str, consume: bool = False
) -> MambaModel:
    """Assemble a :class:`MambaModel` from checked tensors (float32, or the uint16 bits of
    BF16 weights kept 16-bit: ``loader.read_weights``). ``consume``: each layer's tensors leave
    ``tensors`` once packed, so the raw copy of a weight and its panels are not both held
    for the whole load (:func:`load_bytes`)."""
    pin_blas_threads()
    keep_freed_pages()  # each step's new state arrays reuse the last step's pages
    t = tensors
    model_fingerprint = _fingerprint_of(config, t)  # before any tensor leaves
    blocks: list[BlockWeights] = []
    for layer in range(config.num_hidden_layers):
        if config.mamba_version == 2:
            blocks.append(_mamba2_block(config, t, layer))
        else:
            blocks.append(_mamba1_block(config, t, layer))
        if consume:
            for key in [k for k in t if k.startswith(f"backbone.layers.{layer}.")]:
                del t[key]
    return _assemble(config, t, blocks, model_fingerprint, name)


def _decay(t: Mapping[str, np.ndarray], p: str) -> np.ndarray:
    """A layer's A: ``-exp(A_log)`` as numpy computes it, or, where the tensors hold
    ``{p}A`` instead of ``{p}A_log``, that A as it is. A GGUF stores A, not A_log: the
    converter computed ``-exp(A_log)`` with torch, whose float32 exp (MKL's, on x86) and
    numpy's differ in the last bit or two for about 4 values in 10, and A_log cannot be
    recovered from it exactly; taking A as stored computes what the file says, as
    llama.cpp does (``gguf_model``)."""
    return t[p + "A"] if p + "A" in t else -np.exp(t[p + "A_log"])


def _fingerprint_of(config: MambaConfig, t: Mapping[str, np.ndarray | Q8Weight]) -> str:
    """:func:`fingerprint`; for tensors that hold A where a directory holds A_log (a
    GGUF's: :func:`_decay`), the hash of that fingerprint taken with each A in its A_log's
    place, under a tag of its own: never a directory's fingerprint, since the A differ."""
    stored_a = [k for k in t if k.endswith(".mixer.A")]
    if not stored_a:
        return fingerprint(config, t)
    view = {**t, **{k + "_log": t[k] for k in stored_a}}
    inner = fingerprint(config, view)
    return hashlib.sha256(f"ssmserve-model-v1 stored A\0{inner}".encode()).hexdigest()


def _mamba1_block(config: MambaConfig, t: dict[str, np.ndarray], layer: int) -> MambaBlockWeights:
    p = f"backbone.layers.{layer}.mixer."
    return MambaBlockWeights(
        norm=t[f"backbone.layers.{layer}.norm.weight"],
        in_proj=RowStableLinear(t[p + "in_proj.weight"], t.get(p + "in_proj.bias")),
        conv_weight=np.ascontiguousarray(t[p + "conv1d.weight"][:, 0, :]),  # (e, k)
        conv_bias=t.get(p + "conv1d.bias"),
        x_proj=RowStableLinear(t[p + "x_proj.weight"]),
        dt_proj=RowStableLinear(t[p + "dt_proj.weight"], t[p + "dt_proj.bias"]),
        A=_decay(t, p),  # (e, n)
        D=t[p + "D"],
        out_proj=RowStableLinear(t[p + "out_proj.weight"], t.get(p + "out_proj.bias")),
        mixer_rms_eps=config.mixer_rms_eps,
    )


def _assemble(
    config: MambaConfig,
    t: dict[str, np.ndarray],
    blocks: list[BlockWeights],
    model_fingerprint: str,
    name: str,
) -> MambaModel:
    """The model around its blocks: the ends (embeddings or input projection, final norm,
    head, normalisation)."""
    if config.is_token_model:
        embeddings = t["backbone.embeddings.weight"]
        tied = config.tie_word_embeddings
        return MambaModel(
            config,
            blocks,
            t["backbone.norm_f.weight"],
            RowStableLinear(embeddings if tied else t["lm_head.weight"]),
            embeddings=None if tied else embeddings,  # tied: looked up in the head's panels
            fingerprint=model_fingerprint,
            name=name,
        )
    return MambaModel(
        config,
        blocks,
        t["backbone.norm_f.weight"],
        RowStableLinear(t["output_head.weight"], t["output_head.bias"]),
        input_proj=RowStableLinear(t["input_proj.weight"], t["input_proj.bias"]),
        input_norm=_scaling(t, "input_norm") if config.input_normalization else None,
        output_norm=_scaling(t, "output_norm") if config.output_normalization else None,
        fingerprint=model_fingerprint,
        name=name,
    )


def _scaling(t: dict[str, np.ndarray], prefix: str) -> ChannelScaling:
    """``{prefix}.mean`` / ``.std`` as a :class:`ChannelScaling`; a std that is not a
    positive number would divide by zero or flip a channel: refused, named."""
    std = t[f"{prefix}.std"]
    if not (std > 0).all():
        bad = int(np.flatnonzero(~(std > 0))[0])
        raise ModelFormatError(
            f"tensor {prefix}.std: channel {bad} is {std[bad]!r}; every std must be > 0"
        )
    return ChannelScaling(mean=t[f"{prefix}.mean"], std=std)


def _mamba2_block(c: MambaConfig, t: dict[str, np.ndarray], layer: int) -> Mamba2BlockWeights:
    p = f"backbone.layers.{layer}.mixer."
    return Mamba2BlockWeights(
        norm=t[f"backbone.layers.{layer}.norm.weight"],
        in_proj=RowStableLinear(t[p + "in_proj.weight"], t.get(p + "in_proj.bias")),
        conv_weight=np.ascontiguousarray(t[p + "conv1d.weight"][:, 0, :]),  # (c, k)
        conv_bias=t.get(p + "conv1d.bias"),
        dt_bias=t[p + "dt_bias"],
        A=_decay(t, p),  # (h,)
        D=t[p + "D"],
        gated_norm=t[p + "norm.weight"],
        out_proj=RowStableLinear(t[p + "out_proj.weight"], t.get(p + "out_proj.bias")),
        groups=c.n_groups,
        time_step_limit=c.time_step_limit,
        eps=c.layer_norm_epsilon,
    )
