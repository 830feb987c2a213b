"""Recurrent state of sessions: per layer a conv window and an SSM state.

Mamba-1: conv (e, k) and ssm (e, n); Mamba-2: conv (e + 2 g n, k) and ssm (h, p, n).

``SessionState`` is one session's state; ``BatchState`` stacks many along a leading batch
axis so one engine call steps them all. Both are plain float32 numpy arrays: states are
values (the engine returns new arrays instead of writing into old ones), so a failed or
rejected step can never leave a session half-updated.

Shape letters: b batch, e inner size (d_inner), k conv kernel, n SSM state size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class LayerState:
    conv: np.ndarray  # (c, k) the last k conv inputs, newest at [:, -1]
    ssm: np.ndarray  # (e, n) | (h, p, n) the SSM hidden state h_t


@dataclass(frozen=True, slots=True)
class StateLayout:
    """Where a state's arrays sit in one packed float32 buffer: layer by layer, conv then
    ssm. Made by :func:`state_layout` (cached), so a model's states share one."""

    num_layers: int
    conv_shape: tuple[int, ...]
    ssm_shape: tuple[int, ...]

    @property
    def size(self) -> int:
        """Floats in a packed state: L * (|conv| + |ssm|)."""
        return self.num_layers * (math.prod(self.conv_shape) + math.prod(self.ssm_shape))

    def views(self, buffer: np.ndarray) -> tuple[LayerState, ...]:
        """Per layer, the conv and ssm arrays as views into ``buffer`` (size,)."""
        conv_size, ssm_size = math.prod(self.conv_shape), math.prod(self.ssm_shape)
        layers = []
        at = 0
        for _ in range(self.num_layers):
            conv = buffer[at : at + conv_size].reshape(self.conv_shape)  # (c, k)
            ssm = buffer[at + conv_size : at + conv_size + ssm_size].reshape(self.ssm_shape)
            layers.append(LayerState(conv, ssm))
            at += conv_size + ssm_size
        return tuple(layers)


@functools.lru_cache(maxsize=64)
def state_layout(
    num_layers: int, conv_shape: tuple[int, ...], ssm_shape: tuple[int, ...]
) -> StateLayout:
    """The one :class:`StateLayout` of these shapes (so thousands of states share it)."""
    return StateLayout(num_layers, conv_shape, ssm_shape)


class SessionState:
    """One session's state: per layer a conv window and an SSM state.

    Three forms, the same values to every reader of ``layers``:

    * a *row* of a batched step's :class:`BatchState`: it holds the batch and its row
      number, and builds its per-layer views only when asked (``layers``). A stepper runs
      several ticks of the same sessions in a row, and :meth:`BatchState.stack` recognises
      rows of one batch in order and steps that batch again as it is: per step, no views,
      no per-layer objects and no stacking.
    * *packed*: one float32 buffer and its shared :class:`StateLayout`; ``layers`` are
      views made on each read and not kept. Why: a worker holds thousands of idle
      sessions, and a state of per-layer arrays costs an array object and an allocator
      block per array and a ``LayerState`` per layer (~0.55 KiB per demo session, 2.6%).
      :meth:`copy`, :meth:`unpacked` and ``MambaModel.new_state`` make this form.
    * per-layer arrays (``SessionState(layers)``), as a checkpoint is decoded.
    """

    __slots__ = ("_batch", "_layers", "_layout", "_packed", "_row")

    def __init__(self, layers: tuple[LayerState, ...]) -> None:
        self._layers: tuple[LayerState, ...] | None = layers
        self._batch: BatchState | None = None
        self._row = -1
        self._packed: np.ndarray | None = None
        self._layout: StateLayout | None = None

    @classmethod
    def row_of(cls, batch: BatchState, row: int) -> SessionState:
        """Row ``row`` of ``batch`` (views into it once ``layers`` is read; no copy)."""
        state = cls.__new__(cls)
        state._layers, state._batch, state._row = None, batch, row
        state._packed, state._layout = None, None
        return state

    @classmethod
    def of_buffer(cls, buffer: np.ndarray, layout: StateLayout) -> SessionState:
        """The state packed in ``buffer`` (size,) float32 as ``layout`` says (no copy)."""
        if buffer.dtype != np.float32 or buffer.shape != (layout.size,):
            raise ValueError(
                f"a packed state of {layout.num_layers} layers of conv {layout.conv_shape} "
                f"and ssm {layout.ssm_shape} is float32 ({layout.size},), got "
                f"{buffer.dtype} {buffer.shape}"
            )
        state = cls.__new__(cls)
        state._layers, state._batch, state._row = None, None, -1
        state._packed, state._layout = buffer, layout
        return state

    @property
    def layers(self) -> tuple[LayerState, ...]:
        if self._layers is not None:
            return self._layers
        if self._packed is not None:
            assert self._layout is not None
            return self._layout.views(self._packed)  # not kept: see the class doc
        batch, row = self._batch, self._row
        assert batch is not None
        self._layers = tuple(
            LayerState(c[row], s[row]) for c, s in zip(batch.conv, batch.ssm, strict=True)
        )
        return self._layers

    @property
    def layout(self) -> StateLayout:
        if self._layout is not None:
            return self._layout
        if self._layers is None and self._batch is not None:  # a row: no views needed
            batch = self._batch
            return state_layout(len(batch.conv), batch.conv[0].shape[1:], batch.ssm[0].shape[1:])
        layers = self.layers
        return state_layout(len(layers), layers[0].conv.shape, layers[0].ssm.shape)

    @property
    def nbytes(self) -> int:
        if self._packed is not None:
            return self._packed.nbytes
        return sum(layer.conv.nbytes + layer.ssm.nbytes for layer in self.layers)

    @property
    def is_view(self) -> bool:
        """True while the arrays are rows of a stepper batch (which they keep alive), or
        views into some other buffer."""
        if self._packed is not None:
            return self._packed.base is not None
        if self._batch is not None:
            return True
        return any(layer.ssm.base is not None for layer in self.layers)

    def copy(self) -> SessionState:
        """The same state in one buffer of its own (a batch row keeps the whole batch
        alive), packed."""
        return SessionState.of_buffer(self.packed(), self.layout)

    def packed(self) -> np.ndarray:
        """A copy of the state in one float32 buffer ``(L * (|conv| + |ssm|),)``, layer by
        layer, conv then ssm: what a snapshot waiting for its write holds, and what an
        idle session keeps (:meth:`copy`). :meth:`unpacked` reads it."""
        if self._packed is not None:
            return self._packed.copy()
        if self._layers is None and self._batch is not None:  # a row: no views kept
            batch, row = self._batch, self._row
            pairs = zip(batch.conv, batch.ssm, strict=True)
            return np.concatenate([a[row].reshape(-1) for pair in pairs for a in pair])
        return np.concatenate(
            [a.reshape(-1) for layer in self.layers for a in (layer.conv, layer.ssm)]
        )

    def packed_buffer(self) -> np.ndarray | None:
        """The buffer of a packed state itself (no copy: only to read, as a checkpoint's
        encoder does), or None for the other forms."""
        return self._packed

    @classmethod
    def unpacked(
        cls,
        buffer: np.ndarray,
        num_layers: int,
        conv_shape: tuple[int, ...],
        ssm_shape: tuple[int, ...],
    ) -> SessionState:
        """The state :meth:`packed` made, on ``buffer`` (no copy)."""
        return cls.of_buffer(buffer, state_layout(num_layers, tuple(conv_shape), tuple(ssm_shape)))

    def named_arrays(self) -> list[tuple[str, np.ndarray]]:
        """Arrays in a fixed order with stable names (the checkpoint's per-layer entries)."""
        out: list[tuple[str, np.ndarray]] = []
        for i, layer in enumerate(self.layers):
            out.append((f"layers.{i}.conv_state", layer.conv))
            out.append((f"layers.{i}.ssm_state", layer.ssm))
        return out

    @classmethod
    def from_named_arrays(cls, arrays: Sequence[tuple[str, np.ndarray]]) -> SessionState:
        """Inverse of :meth:`named_arrays`; raises ``ValueError`` if names are out of order."""
        if len(arrays) % 2:
            raise ValueError(f"expected conv/ssm pairs per layer, got {len(arrays)} arrays")
        layers = []
        for i in range(len(arrays) // 2):
            (conv_name, conv), (ssm_name, ssm) = arrays[2 * i], arrays[2 * i + 1]
            if (conv_name, ssm_name) != (f"layers.{i}.conv_state", f"layers.{i}.ssm_state"):
                raise ValueError(
                    f"unexpected state arrays {conv_name!r}, {ssm_name!r} at layer {i}"
                )
            layers.append(LayerState(conv, ssm))
        return cls(tuple(layers))

    def bit_equal(self, other: SessionState) -> bool:
        """True when every array has the same dtype, shape and bytes."""
        if len(self.layers) != len(other.layers):
            return False
        return all(
            _same_bits(a.conv, b.conv) and _same_bits(a.ssm, b.ssm)
            for a, b in zip(self.layers, other.layers, strict=True)
        )


@dataclass(frozen=True)
class BatchState:
    conv: tuple[np.ndarray, ...]  # per layer (b, c, k)
    ssm: tuple[np.ndarray, ...]  # per layer (b, e, n) | (b, h, p, n)

    @classmethod
    def stack(cls, states: Sequence[SessionState]) -> BatchState:
        """The states as one batch (new arrays; ``states`` are not changed).

        All rows of one batch, in order, *are* that batch: it is returned as it is (the
        engine never writes into the state it steps). Otherwise rows are gathered per
        source batch, one ``take`` per layer array for all the rows a batch gives (a worker
        with thousands of sessions forms each batch from rows of a few earlier ones), and
        states of their own are copied in one by one.
        """
        if not states:
            raise ValueError("cannot stack an empty list of session states")
        source = states[0]._batch
        if (
            source is not None
            and len(states) == source.batch_size
            and all(s._batch is source and s._row == i for i, s in enumerate(states))
        ):
            return source
        # Positions in the new batch and rows in the source, per source batch.
        by_source: dict[int, tuple[BatchState, list[int], list[int]]] = {}
        own: list[int] = []
        for position, s in enumerate(states):
            if s._batch is None:
                own.append(position)
                continue
            group = by_source.get(id(s._batch))
            if group is None:
                group = by_source[id(s._batch)] = (s._batch, [], [])
            group[1].append(position)
            group[2].append(s._row)
        first = states[0].layers
        b = len(states)
        conv = tuple(np.empty((b, *layer.conv.shape), np.float32) for layer in first)
        ssm = tuple(np.empty((b, *layer.ssm.shape), np.float32) for layer in first)
        for batch, positions, rows in by_source.values():
            index = np.asarray(rows, np.intp)
            lo, hi = positions[0], positions[-1] + 1
            contiguous = hi - lo == len(positions)  # the rows fill one range of the batch
            for outs, ins in ((conv, batch.conv), (ssm, batch.ssm)):
                for out, arr in zip(outs, ins, strict=True):
                    if contiguous:
                        np.take(arr, index, axis=0, out=out[lo:hi])
                    else:
                        out[positions] = arr.take(index, axis=0)
        for position in own:
            for i, layer in enumerate(states[position].layers):
                conv[i][position] = layer.conv
                ssm[i][position] = layer.ssm
        return cls(conv, ssm)

    @property
    def batch_size(self) -> int:
        return self.conv[0].shape[0]

    def session(self, row: int) -> SessionState:
        """Row ``row`` as a session state (views into this batch, no copy)."""
        return SessionState.row_of(self, row)

    def sessions(self) -> list[SessionState]:
        return [self.session(i) for i in range(self.batch_size)]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
