"""8-bit weights: llama.cpp's Q8_0, and why they keep every exactness promise.

Q8_0 cuts each row of a weight into blocks of ``Q8_BLOCK`` = 32 values and stores each
block as 32 int8 ``q`` and one float16 scale ``d``; a value is ``d * q``. That product is
exact in float32: ``d`` has 11 significant bits and ``q`` at most 8, so ``d * q`` has at
most 19 of float32's 24 (and float16's range sits far inside float32's). So the engine
widens each weight as it loads it (int8 -> float32, times the widened scale: both exact)
and then runs the products' one fixed order unchanged: a Q8_0 model's outputs are, bit for
bit, those of the float32 model holding the dequantized weights, at every batch size,
stepping or prefill (``tests/test_q8_weights.py``). Batch invariance, prefill == stepping
and exact replay hold as they do for float32.

Quantising is llama.cpp's reference (``quantize_row_q8_0_ref`` in ggml-quants.c, and
``gguf.quants.Q8_0`` in its Python package, which the converter uses)::

    amax = max |x| over the block         (float32)
    d    = amax / 127                     (float32)
    q    = roundf(x * (1 / d))            (0 where d == 0; halves away from zero)
    stored: float16(d), int8(q)

so ``--quantize q8_0`` of a float32 model gives the bytes of the Q8_0 GGUF that
``convert_hf_to_gguf.py --outtype q8_0`` writes of it (``tests/test_q8_weights.py`` checks
against ``gguf.quants``). A weight whose input width is not a multiple of 32 is not
quantised (llama.cpp keeps such tensors in 16 or 32 bits too): Mamba-1's ``dt_proj`` at a
Δ rank of 48, for one.

Glossary: o output features (rows of a weight), i input features, nb = i / 32 blocks a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Values per Q8_0 block (llama.cpp's QK8_0).
Q8_BLOCK = 32
#: Bytes of one block as GGUF stores it: a float16 scale, then 32 int8.
Q8_BLOCK_BYTES = 2 + Q8_BLOCK
#: Values quantised at a time: a chunk's float32 temporaries (about six copies of it)
#: bound the memory quantising takes beyond its result, whatever the weight's size.
CHUNK_VALUES = 1 << 18
#: Bytes quantising holds beyond the weight and its result (``model_tensors.load_bytes``).
QUANTIZE_TRANSIENT_BYTES = 8 * 4 * CHUNK_VALUES
#: The formats ``--quantize`` takes (``none`` keeps each weight at its stored precision).
QUANTIZATIONS = ("none", "q8_0")


@dataclass(frozen=True)
class Q8Weight:
    """A weight (o, i) in Q8_0: ``quants`` (o, i) int8 and ``scales`` (o, nb) float16,
    value ``[r, k] = scales[r, k // 32] * quants[r, k]`` (exact in float32)."""

    quants: np.ndarray  # (o, i) int8
    scales: np.ndarray  # (o, nb) float16

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.quants.shape)

    @property
    def nbytes(self) -> int:
        return int(self.quants.nbytes + self.scales.nbytes)

    def __getitem__(self, rows: object) -> Q8Weight:
        """The rows ``rows`` (an index array or slice), still quantised: an embedding
        lookup reads only the rows it needs (``numerics.widened`` gives their values)."""
        quants, scales = self.quants[rows], self.scales[rows]  # type: ignore[index]
        return Q8Weight(quants, scales)

    def dequantized(self) -> np.ndarray:
        """The float32 values, (…, i): exact (see the module docstring)."""
        lead = self.quants.shape[:-1]
        blocks = self.quants.reshape(*lead, -1, Q8_BLOCK).astype(np.float32)  # (…, nb, 32)
        scales = self.scales.astype(np.float32)[..., None]  # (…, nb, 1)
        return (blocks * scales).reshape(self.quants.shape)


def quantizable(weight_shape: tuple[int, ...]) -> bool:
    """Whether a 2-D weight can be Q8_0: its rows split into whole blocks of 32."""
    return len(weight_shape) == 2 and weight_shape[1] % Q8_BLOCK == 0 and weight_shape[1] > 0


def quantize_q8_0(weight: np.ndarray) -> Q8Weight:
    """``weight`` (o, i) float32, or uint16 bfloat16 / int16 float16 bits (widened a chunk
    at a time, so
    a big 16-bit weight is never held whole in float32), i a multiple of 32 -> its Q8_0
    form, as llama.cpp's reference quantises it. ``ValueError`` for a shape that is not
    whole blocks, or for a block whose scale overflows float16 (a weight above ~8.3e6)."""
    if not quantizable(weight.shape):
        raise ValueError(f"Q8_0 needs a 2-D weight of whole 32-blocks a row, got {weight.shape}")
    o, i = weight.shape
    quants = np.empty((o, i), np.int8)
    scales = np.empty((o, i // Q8_BLOCK), np.float16)
    chunk = max(1, CHUNK_VALUES // i)  # rows
    for r0 in range(0, o, chunk):
        part = weight[r0 : r0 + chunk]
        if part.dtype == np.uint16:  # bfloat16 bits: the high half of a float32 (exact)
            part = (part.astype(np.uint32) << np.uint32(16)).view(np.float32)
        elif part.dtype == np.int16:  # float16 bits (exact)
            part = part.view(np.float16).astype(np.float32)
        part = np.asarray(part, np.float32)
        blocks = part.reshape(part.shape[0], -1, Q8_BLOCK)  # (rows, nb, 32)
        d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)  # (rows, nb, 1)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)  # (rows, nb, 1)
        quants[r0 : r0 + part.shape[0]] = _roundf(blocks * inv).reshape(part.shape[0], i)
        with np.errstate(over="ignore"):  # an overflow is refused just below
            half = d[..., 0].astype(np.float16)  # (rows, nb)
        if not np.isfinite(half).all():
            raise ValueError("a Q8_0 block's scale overflows float16 (a weight above ~8.3e6)")
        scales[r0 : r0 + part.shape[0]] = half
    return Q8Weight(quants, scales)


def _roundf(x: np.ndarray) -> np.ndarray:
    """C's ``roundf``: to nearest, halves away from zero (numpy's ``rint`` ties to even).
    ``floor(a) + floor(2 (a - floor(a)))`` rather than ``floor(a + 0.5)``, whose sum rounds
    (0.49999997 + 0.5 is 1.0 in float32): both steps here are exact."""
    a = np.abs(x)
    whole = np.floor(a)
    return (np.sign(x) * (whole + np.floor(2 * (a - whole)))).astype(np.int8)


def from_blocks(raw: np.ndarray, shape: tuple[int, int]) -> Q8Weight:
    """GGUF's Q8_0 bytes (uint8, o * nb * 34: per block a float16 scale then 32 int8)
    -> a :class:`Q8Weight` of ``shape`` (o, i)."""
    o, i = shape
    blocks = np.ascontiguousarray(raw, np.uint8).reshape(o, i // Q8_BLOCK, Q8_BLOCK_BYTES)
    scales = np.ascontiguousarray(blocks[..., :2]).view("<f2").reshape(o, i // Q8_BLOCK)
    quants = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(o, i)
    return Q8Weight(quants, scales.astype(np.float16))


def to_blocks(weight: Q8Weight) -> np.ndarray:
    """:func:`from_blocks`' inverse: (o, nb * 34) uint8, as GGUF stores the tensor."""
    o, i = weight.shape
    scales = weight.scales.astype("<f2").view(np.uint8).reshape(o, i // Q8_BLOCK, 2)
    quants = weight.quants.view(np.uint8).reshape(o, i // Q8_BLOCK, Q8_BLOCK)
    return np.concatenate([scales, quants], axis=-1).reshape(o, -1)
