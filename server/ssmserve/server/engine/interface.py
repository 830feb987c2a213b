"""What the serving code asks of an engine: the one interface both engines implement.

``MambaModel`` (``mamba.py``, numpy + numba on the CPU, the default) and ``GpuMambaModel``
(``gpu/model.py``, Triton kernels on a GPU, ``--engine cuda``) both satisfy it. States
cross it as numpy ``SessionState`` / ``BatchState``, so checkpoints, the store and
migration do not know which engine computed them; the worker's numerics signature does
(``numerics.numerics_description`` or ``gpu.numerics.gpu_numerics_description``), and a
session never replays on other numerics.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Protocol

import numpy as np

from ssmserve.server.engine.config import MambaConfig
from ssmserve.server.engine.prefill import OutputRows
from ssmserve.server.engine.recurrent_state import BatchState, SessionState

#: The engines a worker or ``ssmserve model`` can run: cpu (``mamba.py``), cuda (``gpu/``).
ENGINES = ("cpu", "cuda")


class Engine(Protocol):
    """One loaded model: read-only weights, pure batched steps and prefills."""

    config: MambaConfig
    name: str
    fingerprint: str  # of the weights and config: a checkpoint names the model it needs

    @property
    def threads(self) -> int:
        """Runners a prefill may spread its chunks over (the lane makes ``threads - 1``)."""
        ...

    @property
    def flops_per_step(self) -> int:
        """The products' FLOPs of one session-step (the lane's offload threshold reads it)."""
        ...

    def new_state(self) -> SessionState: ...

    def check_state(self, state: SessionState) -> None: ...

    def check_inputs(self, inputs: np.ndarray, batch: int | None = None) -> np.ndarray: ...

    def step(self, state: BatchState, inputs: np.ndarray) -> tuple[BatchState, np.ndarray]:
        """``b`` sessions one input each: (new states, outputs (b, o)); ``state`` unchanged."""
        ...

    def prefill(
        self,
        inputs: np.ndarray,
        state: SessionState | None = None,
        outputs: OutputRows = "all",
        helpers: Sequence[Executor] | None = None,
    ) -> tuple[np.ndarray, SessionState]:
        """One session through a run of T inputs with the bits of T steps: (the outputs
        ``outputs`` names, the state after)."""
        ...

    def run(
        self, inputs: np.ndarray, state: SessionState | None = None
    ) -> tuple[np.ndarray, SessionState]:
        """One session stepped through ``inputs`` one at a time: (outputs (T, o), state)."""
        ...
