"""The input log: every input a session applied, with its step number, replayable.

Durably the log lives in Redis (``state.store``), one entry per step holding the input's raw
little-endian bytes. In memory a session keeps :class:`RecentSteps`: the newest inputs
(the history carried by its checkpoints), the newest outputs (answers to resent steps), and
the inputs not yet written to Redis (``unflushed``; in ``log`` durability this empties on
every tick, in the other modes at each snapshot).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from ssmserve.server.engine.config import MambaConfig


class InputCodec:
    """One input <-> the bytes stored in the log: int64 token id or float32 (i,) vector."""

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

    def empty(self) -> np.ndarray:
        return np.empty((0,) if self.token else (0, self.width), self.dtype)


class RecentSteps:
    """The newest inputs and outputs of one session, by step, plus its unflushed inputs."""

    def __init__(self, input_window: int, output_window: int) -> None:
        self.inputs: deque[tuple[int, bytes]] = deque(maxlen=input_window)
        self.outputs: deque[tuple[int, np.ndarray]] = deque(maxlen=output_window)
        self.unflushed: list[tuple[int, bytes]] = []

    def record(self, step: int, raw_input: bytes, output: np.ndarray) -> None:
        self.inputs.append((step, raw_input))
        self.outputs.append((step, output))
        self.unflushed.append((step, raw_input))

    def remember(self, first: int, raw: Sequence[bytes], outputs: Sequence[np.ndarray]) -> None:
        """Steps ``first, first + 1, ...`` recomputed by replay: already in the log."""
        for i, (raw_input, output) in enumerate(zip(raw, outputs, strict=True)):
            self.inputs.append((first + i, raw_input))
            self.outputs.append((first + i, output))

    def remember_output(self, step: int, output: np.ndarray) -> None:
        """The output of ``step`` known from elsewhere (a fork's first step)."""
        self.outputs.append((step, output))

    def output_at(self, step: int) -> np.ndarray | None:
        if self.outputs and self.outputs[0][0] <= step <= self.outputs[-1][0]:
            found_step, output = self.outputs[step - self.outputs[0][0]]
            if found_step == step:
                return output
        return None

    def input_at(self, step: int) -> bytes | None:
        if self.inputs and self.inputs[0][0] <= step <= self.inputs[-1][0]:
            found_step, raw = self.inputs[step - self.inputs[0][0]]
            if found_step == step:
                return raw
        return None

    def history(self, upto: int, window: int) -> tuple[int, list[bytes]]:
        """(first step, inputs) of the newest contiguous ``window`` inputs ending at ``upto``."""
        chosen: list[bytes] = []
        step = upto
        while len(chosen) < window and (raw := self.input_at(step)) is not None:
            chosen.append(raw)
            step -= 1
        chosen.reverse()
        return step + 1, chosen

    def take_unflushed(self) -> list[tuple[int, bytes]]:
        out, self.unflushed = self.unflushed, []
        return out

    def restore_unflushed(self, entries: list[tuple[int, bytes]]) -> None:
        """Put back inputs whose write failed, ahead of anything recorded since."""
        self.unflushed[:0] = entries

    def cut_after(self, step: int) -> None:
        """Forget everything after ``step`` (rollback)."""
        for ring in (self.inputs, self.outputs):
            while ring and ring[-1][0] > step:
                ring.pop()
        self.unflushed = [(s, raw) for s, raw in self.unflushed if s <= step]
