"""The input log: every input a session applied, with its step number, replayable.

Durably the log lives in Redis (``state.store``), one entry per step holding the input's raw
little-endian bytes. In memory a session keeps :class:`RecentSteps`: the newest inputs
(the history carried by its checkpoints), the newest outputs (answers to resent steps), and
the inputs not yet written to Redis (``unflushed``; in ``log`` durability this empties on
every tick, in the other modes at each snapshot).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ssmserve.server.engine.config import MambaConfig


class InputCodec:
    """One input <-> the bytes stored in the log: int64 token id or float32 (i,) vector."""

    __slots__ = ("dtype", "token", "width")

    def __init__(self, config: MambaConfig) -> None:
        self.token = config.is_token_model
        self.dtype = np.dtype("<i8") if self.token else np.dtype("<f4")
        self.width = 1 if self.token else config.input_dim

    def encode(self, value: np.ndarray) -> bytes:
        return np.ascontiguousarray(value, self.dtype).tobytes()

    def decode_many(self, raw: Sequence[bytes]) -> np.ndarray:
        """Stacked inputs ``(T,)`` token ids or ``(T, i)`` float32."""
        flat = np.frombuffer(b"".join(raw), self.dtype)
        if flat.size != len(raw) * self.width:
            raise ValueError("a logged input has the wrong size for this model")
        return flat.copy() if self.token else flat.reshape(len(raw), self.width).copy()

    def decode_rows(self, rows: np.ndarray) -> np.ndarray:
        """Inputs held as raw rows (T, bytes per input) uint8 -> ``(T,)`` token ids or
        ``(T, i)`` float32 (a view of ``rows``)."""
        if rows.ndim != 2 or rows.shape[1] != self.width * self.dtype.itemsize:
            raise ValueError("a held input has the wrong size for this model")
        values = np.ascontiguousarray(rows).view(self.dtype)  # (T, width)
        return values.reshape(rows.shape[0]) if self.token else values

    def empty(self) -> np.ndarray:
        return np.empty((0,) if self.token else (0, self.width), self.dtype)


@functools.lru_cache(maxsize=64)
def input_codec(config: MambaConfig) -> InputCodec:
    """The codec of ``config``'s inputs, one object shared by all of a model's sessions."""
    return InputCodec(config)


@dataclass(frozen=True, slots=True)
class InputBlock:
    """The inputs of steps ``first .. first + count - 1`` of one session, as the log stores
    them, back to back (a session's inputs all have one length): what one log append
    writes, as one bytes object instead of one per step."""

    first: int
    count: int
    data: bytes

    def __post_init__(self) -> None:
        if self.count < 1 or len(self.data) % self.count:
            raise ValueError(f"{len(self.data)} bytes are not {self.count} inputs of one length")

    @classmethod
    def of(cls, first: int, inputs: Sequence[bytes]) -> InputBlock:
        """Separate inputs of steps ``first, first + 1, ...``, all of one length."""
        if not inputs or any(len(x) != len(inputs[0]) for x in inputs):
            raise ValueError("an input block needs inputs, all of one length")
        return cls(first, len(inputs), b"".join(inputs))

    @property
    def last(self) -> int:
        return self.first + self.count - 1

    def inputs(self) -> list[bytes]:
        """One bytes per step, oldest first."""
        width = len(self.data) // self.count
        return [self.data[i : i + width] for i in range(0, len(self.data), width)]


class UnflushedInputs:
    """The inputs a session applied that are not in Redis yet, as one block.

    They are always consecutive steps: each step follows the one before, and a rollback
    cuts the newest ones off. So they are kept as the list of bytes they arrived in (one per
    single step, one per run of steps) and their first step, not as a (step, bytes) pair per
    step: at thousands of sessions those pairs were most of the short-lived objects of a
    tick, and the log append joins them again anyway.
    """

    __slots__ = ("_parts", "count", "first")

    def __init__(self) -> None:
        # Back to back: the inputs of steps first.. A list while there are any; () when
        # empty (after every flush, in thousands of sessions: one shared object where an
        # empty list costs each 56 bytes). Not a tuple throughout: a session that flushes
        # rarely (``none`` durability) adds thousands, and a tuple copies on each add.
        self._parts: list[bytes] | tuple[()] = ()
        self.first = 0  # step of the oldest input (meaningless while empty)
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    @property
    def last(self) -> int:
        return self.first + self.count - 1

    def add(self, first: int, count: int, data: bytes) -> None:
        """Inputs of steps ``first .. first + count - 1``, right after the newest held."""
        if not self.count:
            self.first = first
        elif first != self.first + self.count:
            raise ValueError(
                f"unflushed inputs end at step {self.last}; step {first} does not follow"
            )
        if isinstance(self._parts, list):
            self._parts.append(data)
        else:
            self._parts = [data]
        self.count += count

    def block(self, upto: int | None = None) -> InputBlock | None:
        """The inputs of steps ``first .. upto`` (all when None) as one block; None when
        there are none. Nothing is taken: :meth:`drop` does that once they are written."""
        if not self.count:
            return None
        count = self.count if upto is None else min(self.count, upto - self.first + 1)
        if count <= 0:
            return None
        data = self._joined()
        return InputBlock(self.first, count, data[: count * (len(data) // self.count)])

    def take(self) -> InputBlock | None:
        """All of them as one block, emptied."""
        out = self.block()
        self.drop(self.count)
        return out

    def drop(self, count: int) -> None:
        """Forget the oldest ``count`` inputs (they are in the log now)."""
        if count >= self.count:
            self._parts, self.count = (), 0
            return
        data = self._joined()
        width = len(data) // self.count
        self._parts = [data[count * width :]]
        self.first += count
        self.count -= count

    def cut_after(self, step: int) -> None:
        """Forget the inputs after ``step`` (rollback)."""
        keep = step - self.first + 1
        if keep >= self.count:
            return
        if keep <= 0:
            self._parts, self.count = (), 0
            return
        data = self._joined()
        self._parts = [data[: keep * (len(data) // self.count)]]
        self.count = keep

    def inputs(self, first: int, last: int) -> list[bytes]:
        """One bytes per held step of ``first..last``, oldest first."""
        block = self.block()
        if block is None:
            return []
        lo, hi = max(first, self.first) - self.first, min(last, self.last) - self.first + 1
        return block.inputs()[lo:hi] if hi > lo else []

    def _joined(self) -> bytes:
        if len(self._parts) > 1:
            self._parts = [b"".join(self._parts)]
        return self._parts[0]


def grown_capacity(capacity: int) -> int:
    """The next size of a growing :class:`StepRing`: half as much again, in whole multiples
    of 8 rows (8 -> 16 -> 24 -> 40 -> 64 -> 96 ...)."""
    return max(capacity + 8, -(-capacity * 3 // 16) * 8)


#: Rows of at least this many bytes are held in an array each: no growth slack and no copy
#: when the ring grows. A language model's output row (its logits) is 196 KiB at a 50,280
#: vocabulary; rings grown by half held up to 23 spare ones (4.5 MB per session at 41
#: steps, more than its state). Below this an array per row costs more than its data.
ROW_ARRAY_MIN_BYTES = 4096


class StepRing:
    """The newest ``window`` rows of one width, by step number (a ring).

    Small rows share one array instead of an object per step: a resident session holds
    hundreds of recent inputs and outputs, and per-step tuples, bytes and arrays cost ~10x
    their data in memory and give the garbage collector millions of objects to walk. That
    storage grows by half (:func:`grown_capacity`: 8, 16, 24, 40, 64, 96 ... rows) up to
    ``window`` rows, so a short session does not pay for its whole window, and past 16
    rows holds at most 1.6x the rows it fills. Rows of :data:`ROW_ARRAY_MIN_BYTES` or more
    are held in an array each, grown one row at a time (an object per row is then <3% of
    its data).

    Steps are contiguous: a step that does not follow the newest one starts the ring over
    (a gap can only follow a cut; what the ring lost is a cache miss, read from the log).
    """

    __slots__ = ("_held", "_rows", "_start", "count", "dtype", "first", "window")

    def __init__(self, window: int, dtype: np.dtype | type) -> None:
        self.window = max(window, 0)  # 0: holds nothing
        self.dtype = np.dtype(dtype)
        self._rows: np.ndarray | None = None  # (capacity, width): small rows, on first use
        self._held: list[np.ndarray] | None = None  # capacity arrays (width,): large rows
        self._start = 0  # index (in _rows or _held) of the oldest row
        self.first = 0  # step of the oldest row
        self.count = 0

    def __len__(self) -> int:
        return self.count

    @property
    def last(self) -> int:
        """Step of the newest row (``first - 1`` when empty)."""
        return self.first + self.count - 1

    @property
    def nbytes(self) -> int:
        if self._held is not None:
            return sum(row.nbytes for row in self._held)
        return 0 if self._rows is None else self._rows.nbytes

    def append(self, step: int, row: np.ndarray) -> None:
        """``row`` (w,) as step ``step``, copied in; the oldest row goes once full."""
        if not self.window:
            return
        if self.count and step != self.first + self.count:
            self.count = 0
        if self.count == 0:
            self.first, self._start = step, 0
        if row.shape[-1] * self.dtype.itemsize >= ROW_ARRAY_MIN_BYTES:
            self._append_held(step, row)
            return
        rows = self._rows
        if rows is None or rows.shape[1] != row.shape[-1]:
            rows = self._rows = np.empty((min(8, self.window), row.shape[-1]), self.dtype)
            self._held, self.count, self.first, self._start = None, 0, step, 0
        capacity = rows.shape[0]
        if self.count == capacity:
            if capacity < self.window:  # grow: the rows in order, then room
                size = min(grown_capacity(capacity), self.window)
                grown = np.empty((size, rows.shape[1]), self.dtype)
                grown[: capacity - self._start] = rows[self._start :]
                grown[capacity - self._start : capacity] = rows[: self._start]
                rows, self._rows, self._start = grown, grown, 0
                capacity = rows.shape[0]
            else:  # full: the new row takes the oldest's place
                rows[self._start] = row
                self._start = (self._start + 1) % capacity
                self.first += 1
                return
        rows[(self._start + self.count) % capacity] = row
        self.count += 1

    def _append_held(self, step: int, row: np.ndarray) -> None:
        held = self._held
        if held is None or (held and held[0].shape[0] != row.shape[-1]):
            held = self._held = []
            self._rows, self.count, self.first, self._start = None, 0, step, 0
        capacity = len(held)
        if self.count < capacity:  # a spare array (after a cut or a restart): reuse it
            held[(self._start + self.count) % capacity][...] = row
            self.count += 1
        elif capacity < self.window:  # grow by one array (only a full ring wraps: start 0)
            held.append(np.array(row, self.dtype))
            self.count += 1
        else:  # full: the new row takes the oldest's array
            held[self._start][...] = row
            self._start = (self._start + 1) % capacity
            self.first += 1

    def extend(self, first: int, rows: np.ndarray) -> None:
        """``rows`` (n, w) as steps ``first .. first + n - 1``, copied in: the same as
        appending them one by one, in at most two copies (of small rows)."""
        n = rows.shape[0]
        if not self.window or n == 0:
            return
        if rows.shape[1] * self.dtype.itemsize >= ROW_ARRAY_MIN_BYTES:
            for k in range(max(0, n - self.window), n):  # large rows: one copy each anyway
                self.append(first + k, rows[k])
            return
        if self.count and first != self.first + self.count:
            self.count = 0
        if self._rows is not None and self._rows.shape[1] != rows.shape[1]:
            self._rows, self.count = None, 0
        if self.count == 0 or self._held is not None:
            self._held, self.count, self.first, self._start = None, 0, first, 0
        capacity = 0 if self._rows is None else self._rows.shape[0]
        if self.count + n > capacity and capacity < self.window:  # grow: rows in order
            size = capacity or 8
            while size < self.count + n:  # by steps of one half, as ``append`` grows
                size = grown_capacity(size)
            size = min(size, self.window)
            grown = np.empty((size, rows.shape[1]), self.dtype)
            if self.count:
                grown[: self.count] = self.rows(self.first, self.last)
            self._rows, self._start, capacity = grown, 0, size
        assert self._rows is not None
        if n > capacity:  # only the newest ``capacity`` rows stay
            self._rows[:] = rows[n - capacity :]
            self._start, self.count, self.first = 0, capacity, first + n - capacity
            return
        at = (self._start + self.count) % capacity
        head = min(n, capacity - at)
        self._rows[at : at + head] = rows[:head]
        self._rows[: n - head] = rows[head:]
        total = self.count + n
        if total > capacity:  # full: the new rows took the oldest ones' places
            dropped = total - capacity
            self._start = (self._start + dropped) % capacity
            self.first += dropped
            total = capacity
        self.count = total

    def row(self, step: int) -> np.ndarray | None:
        """Step ``step``'s row (a view: copy it before the ring moves on), or None."""
        if not self.first <= step < self.first + self.count:
            return None
        if self._held is not None:
            return self._held[(self._start + step - self.first) % len(self._held)]
        if self._rows is None:
            return None
        return self._rows[(self._start + step - self.first) % self._rows.shape[0]]

    def rows(self, first: int, last: int) -> np.ndarray:
        """A copy of the rows of steps ``first..last`` (all held), oldest first: (n, w)."""
        if not self.count or not self.first <= first <= last <= self.last:
            raise IndexError(f"steps {first}..{last} are not all held ({self.first}..{self.last})")
        if self._held is not None:
            held, start = self._held, self._start + first - self.first
            return np.stack([held[(start + i) % len(held)] for i in range(last - first + 1)])
        assert self._rows is not None
        n, capacity = last - first + 1, self._rows.shape[0]
        start = (self._start + first - self.first) % capacity
        if start + n <= capacity:
            return self._rows[start : start + n].copy()
        return np.concatenate([self._rows[start:], self._rows[: start + n - capacity]])

    def cut_after(self, step: int) -> None:
        """Forget the rows after ``step``."""
        self.count = max(0, min(self.count, step - self.first + 1))


class RecentSteps:
    """The newest inputs and outputs of one session, by step, plus its unflushed inputs.

    Inputs are kept as the log's raw bytes (a ring of uint8 rows), outputs as float32
    rows; ``unflushed`` holds the inputs not yet in Redis (:class:`UnflushedInputs`)."""

    __slots__ = ("inputs", "outputs", "unflushed")

    def __init__(self, input_window: int, output_window: int) -> None:
        self.inputs = StepRing(input_window, np.uint8)
        self.outputs = StepRing(output_window, np.float32)
        self.unflushed = UnflushedInputs()

    @property
    def nbytes(self) -> int:
        """Bytes of the two rings (what they have allocated so far)."""
        return self.inputs.nbytes + self.outputs.nbytes

    def record(self, step: int, raw_input: bytes, output: np.ndarray, logged: bool = False) -> None:
        """A step just applied: its input (also unflushed, unless ``logged``: sent to the
        log already) and its output ``(o,)``."""
        self.inputs.append(step, np.frombuffer(raw_input, np.uint8))
        self.outputs.append(step, output)
        if not logged:
            self.unflushed.add(step, 1, raw_input)

    def record_run(
        self, first: int, raw_inputs: bytes, outputs: np.ndarray, logged: bool = False
    ) -> None:
        """Steps ``first .. first + n - 1`` just applied: their inputs as the log stores
        them, back to back (also unflushed, unless ``logged``), and their outputs ``(n, o)``."""
        n = outputs.shape[0]
        width = len(raw_inputs) // n
        self.inputs.extend(first, np.frombuffer(raw_inputs, np.uint8).reshape(n, width))
        self.outputs.extend(first, outputs)
        if not logged:
            self.unflushed.add(first, n, raw_inputs)

    def record_picked(
        self,
        first: int,
        raw_inputs: bytes,
        count: int,
        picked: np.ndarray,
        outputs: np.ndarray,
        logged: bool = False,
    ) -> None:
        """Steps ``first .. first + count - 1`` just applied, only some with outputs (a
        prefill computes those it is asked for): their inputs as :meth:`record_run` takes
        them, and ``outputs`` ``(m, o)`` of steps ``first + picked`` (increasing). The
        output ring holds consecutive steps only, so it keeps the outputs after the last
        step without one; a step it lacks is replayed if asked for again."""
        width = len(raw_inputs) // count
        self.inputs.extend(first, np.frombuffer(raw_inputs, np.uint8).reshape(count, width))
        for k, output in zip(picked.tolist(), outputs, strict=True):
            self.outputs.append(first + k, output)
        if not logged:
            self.unflushed.add(first, count, raw_inputs)

    def remember(self, first: int, raw: Sequence[bytes], outputs: Sequence[np.ndarray]) -> None:
        """Steps ``first, first + 1, ...`` recomputed by replay: already in the log."""
        for i, (raw_input, output) in enumerate(zip(raw, outputs, strict=True)):
            self.inputs.append(first + i, np.frombuffer(raw_input, np.uint8))
            self.outputs.append(first + i, output)

    def remember_inputs(self, first: int, raw: Sequence[bytes]) -> None:
        """Inputs of steps ``first, first + 1, ...`` known from elsewhere (a checkpoint's
        history window): already in the log."""
        for i, raw_input in enumerate(raw):
            self.inputs.append(first + i, np.frombuffer(raw_input, np.uint8))

    def restored(
        self,
        codec: InputCodec,
        history_first: int,
        history: np.ndarray,
        step: int,
        output: np.ndarray | None,
        replayed: Sequence[bytes],
        outputs_from: int,
        outputs: Sequence[np.ndarray],
    ) -> None:
        """What a session rebuilt from its snapshot at ``step`` knows, all already in the
        log: the snapshot's input history window (``history``, values of steps
        ``history_first ..``) and output at ``step`` (None: not kept), the ``replayed``
        inputs of the steps after it, and ``outputs`` of steps ``outputs_from ..``. One
        call, so a load fills memory without going back and forth."""
        self.remember_inputs(history_first, [codec.encode(value) for value in history])
        if output is not None:
            self.outputs.append(step, output)
        self.remember_inputs(step + 1, replayed)
        for i, row in enumerate(outputs):
            self.outputs.append(outputs_from + i, row)

    def remember_output(self, step: int, output: np.ndarray) -> None:
        """The output of ``step`` known from elsewhere (a fork's first step)."""
        self.outputs.append(step, output)

    def output_at(self, step: int) -> np.ndarray | None:
        """A copy of step ``step``'s output ``(o,)``, or None when not held."""
        row = self.outputs.row(step)
        return None if row is None else row.copy()

    def input_at(self, step: int) -> bytes | None:
        row = self.inputs.row(step)
        return None if row is None else row.tobytes()

    def history(self, upto: int, window: int) -> tuple[int, np.ndarray | None]:
        """(first step, raw inputs (T, bytes per input) uint8) of the newest ``window``
        held inputs ending at ``upto``; ``(upto + 1, None)`` when ``upto`` is not held."""
        if window <= 0 or self.inputs.row(upto) is None:
            return upto + 1, None
        first = max(self.inputs.first, upto - window + 1)
        return first, self.inputs.rows(first, upto)

    def cut_after(self, step: int) -> None:
        """Forget everything after ``step`` (rollback)."""
        self.inputs.cut_after(step)
        self.outputs.cut_after(step)
        self.unflushed.cut_after(step)
