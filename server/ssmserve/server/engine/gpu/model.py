"""``GpuMambaModel``: a Mamba or Mamba-2 stack on the fixed-order Triton kernels.

The public surface is ``MambaModel``'s where the serving code uses it (``config``,
``name``, ``fingerprint``, ``new_state``, ``check_state``, ``check_inputs``, ``step``,
``prefill``, ``run``), and states cross it as the same numpy ``SessionState`` /
``BatchState`` (checkpoints keep their format); inside, states and activations are
tensors on the device. :meth:`GpuMambaModel.step_device` steps a :class:`DeviceBatch`
without a host round trip: the seam for a device slot pool and CUDA-graph replay per
batch-size bucket (not built here: neither can run without a GPU).

The residual stream is float64, normed in float64 and rounded once to float32, as the
CPU engine's (``kernels.rms_norm_rows`` says why); everything else is float32. The
products' weights stay in their stored precision on the device (BF16, F16 or float32:
``launch.narrowest_exact``), widened exactly as the kernels load them, so every product
accumulates in float32 and has the bits of float32 weights.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from ssmserve.server.engine.config import MambaConfig
from ssmserve.server.engine.gpu import launch
from ssmserve.server.engine.gpu.graphs import GraphBuffers, StepGraphs
from ssmserve.server.engine.gpu.launch import DeviceLinear
from ssmserve.server.engine.gpu.layers import Layer, Mamba1Layer, Mamba2Layer
from ssmserve.server.engine.gpu.numerics import (
    gpu_numerics_description,
    gpu_numerics_signature,
)
from ssmserve.server.engine.gpu.runtime import default_device
from ssmserve.server.engine.loader import is_gguf, read_config, read_weights
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.model_tensors import fingerprint
from ssmserve.server.engine.prefill import OutputRows, output_rows
from ssmserve.server.engine.recurrent_state import BatchState, SessionState, state_layout
from ssmserve.server.errors import ModelFormatError

#: Positions of a prefill computed per pass: bounds its activations' memory (the state
#: carries from one pass to the next, so the size changes no bits).
CHUNK_ROWS = 4096


def _to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """A copy of ``arr`` on ``device`` (never a view the kernels could write through)."""
    return torch.from_numpy(np.array(arr, copy=True)).to(device)


@dataclass(frozen=True)
class DeviceBatch:
    """A batch's states on the device: per layer conv (b, c, k) and ssm (b, e, n) |
    (b, h, p, n), float32. Values, as ``BatchState``: a step makes new tensors."""

    conv: tuple[torch.Tensor, ...]
    ssm: tuple[torch.Tensor, ...]

    @classmethod
    def from_host(cls, state: BatchState, device: torch.device) -> DeviceBatch:
        return cls(
            tuple(_to_device(a, device) for a in state.conv),
            tuple(_to_device(a, device) for a in state.ssm),
        )

    def to_host(self) -> BatchState:
        return BatchState(
            tuple(t.cpu().numpy() for t in self.conv), tuple(t.cpu().numpy() for t in self.ssm)
        )

    @property
    def batch_size(self) -> int:
        return self.conv[0].shape[0]


class GpuMambaModel:
    """Read-only weights on a device plus the batched :meth:`step` and :meth:`prefill`,
    each output row's bits independent of the batch and of prefill vs step
    (``engine.interface.Engine``)."""

    #: A prefill runs on one host thread: the device does the parallel work.
    threads = 1

    def __init__(
        self,
        config: MambaConfig,
        tensors: dict[str, np.ndarray],
        *,
        name: str = "",
        device: torch.device | None = None,
    ) -> None:
        _check_supported(config, name)
        self.config = config
        self.name = name
        self.fingerprint = fingerprint(config, tensors)
        self.device = device if device is not None else default_device()
        dev = self.device
        c = config
        self.layers: tuple[Layer, ...] = tuple(
            Mamba2Layer.of(c, tensors, i, dev) if c.mamba_version == 2 else
            Mamba1Layer.of(tensors, i, dev)
            for i in range(c.num_hidden_layers)
        )  # fmt: skip
        self.norm_f = _to_device(tensors["backbone.norm_f.weight"], dev)
        self.eps = torch.tensor([c.layer_norm_epsilon], dtype=torch.float64, device=dev)
        self.embeddings: torch.Tensor | None = None  # (v, d); None: tied or a signal model
        self.input_proj: DeviceLinear | None = None
        if c.is_token_model:
            table = tensors["backbone.embeddings.weight"]
            head = table if c.tie_word_embeddings else tensors["lm_head.weight"]
            self.head = DeviceLinear.of(head, None, dev)
            if not c.tie_word_embeddings:
                self.embeddings = _to_device(table, dev)
        else:
            self.head = DeviceLinear.of(
                tensors["output_head.weight"], tensors["output_head.bias"], dev
            )
            self.input_proj = DeviceLinear.of(
                tensors["input_proj.weight"], tensors["input_proj.bias"], dev
            )
        layout = state_layout(c.num_hidden_layers, c.conv_state_shape, c.ssm_state_shape)
        zeros = np.zeros(layout.size, np.float32)
        zeros.flags.writeable = False
        self._zero_state = (zeros, layout)
        self._graphs_lock = threading.Lock()

    @classmethod
    def load(
        cls, directory: str | Path, name: str | None = None, device: torch.device | None = None
    ) -> GpuMambaModel:
        """Read and check a model directory as ``load_model`` does, onto ``device``."""
        path = Path(directory)
        if is_gguf(path):  # its A is stored, not A_log (model_tensors._decay): not on the GPU yet
            raise ModelFormatError(
                f"{path.name}: the GPU engine does not read GGUF files yet; serve it with "
                f"--engine cpu"
            )
        config = read_config(path)
        _check_supported(config, name or path.resolve().name)  # before reading the weights
        tensors = read_weights(path, config)
        return cls(config, tensors, name=name or path.resolve().name, device=device)

    @cached_property
    def numerics(self) -> str:
        """What this engine's bits depend on, one line (``gpu_numerics_description``)."""
        return gpu_numerics_description(self.device)

    @cached_property
    def numerics_signature(self) -> str:
        return gpu_numerics_signature(self.device)

    @cached_property
    def flops_per_step(self) -> int:
        """FLOPs of the products for one session-step (as ``MambaModel.flops_per_step``)."""
        linears = [lin for layer in self.layers for lin in layer.linears]
        linears += [self.head] + ([self.input_proj] if self.input_proj is not None else [])
        return sum(2 * lin.in_features * lin.out_features for lin in linears)

    # ------------------------------------------------------------------ state and inputs

    def new_state(self) -> SessionState:
        """All zeros, one shared read-only buffer (as ``MambaModel.new_state``)."""
        zeros, layout = self._zero_state
        return SessionState.of_buffer(zeros, layout)

    # Both read only ``self.config``: one set of rules and messages for both engines.
    check_state = MambaModel.check_state
    check_inputs = MambaModel.check_inputs

    # ------------------------------------------------------------------ the step

    def step(self, state: BatchState, inputs: np.ndarray) -> tuple[BatchState, np.ndarray]:
        """Advance ``b`` sessions by one input each; returns (new state, outputs (b, o)),
        as ``MambaModel.step`` (inputs already checked; ``state`` is not modified). On a
        GPU the step is replayed as the CUDA graph of the batch's size bucket
        (``graphs.py``: the same bits as the eager step)."""
        batch = DeviceBatch.from_host(state, self.device)
        with self._graphs_lock:  # the buckets' buffers are shared
            conv, ssm, out = self._graphs.step(batch.conv, batch.ssm, self._inputs(inputs))
            return DeviceBatch(conv, ssm).to_host(), out.cpu().numpy()

    @cached_property
    def _graphs(self) -> StepGraphs:
        def eager(
            conv: tuple[torch.Tensor, ...], ssm: tuple[torch.Tensor, ...], x: torch.Tensor
        ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor]:
            new, out = self.step_device(DeviceBatch(conv, ssm), x)
            return new.conv, new.ssm, out

        one = DeviceBatch.from_host(BatchState.stack([self.new_state()]), self.device)
        c = self.config
        x = np.zeros(1, np.int64) if c.is_token_model else np.zeros((1, c.input_dim), np.float32)
        template = GraphBuffers(1, self._inputs(x), one.conv, one.ssm)
        return StepGraphs(eager, self.device, template)

    def step_device(
        self, batch: DeviceBatch, inputs: torch.Tensor
    ) -> tuple[DeviceBatch, torch.Tensor]:
        """:meth:`step` on device tensors: ``inputs`` ids (b,) int64 or (b, i) float32."""
        xn, new = self._trunk(inputs, batch, positions=1)
        return new, launch.product(xn, self.head)

    def _inputs(self, inputs: np.ndarray) -> torch.Tensor:
        dtype = np.int64 if self.config.is_token_model else np.float32
        return _to_device(np.asarray(inputs, dtype), self.device)

    def _trunk(
        self, inputs: torch.Tensor, batch: DeviceBatch, positions: int
    ) -> tuple[torch.Tensor, DeviceBatch]:
        """Rows ``s T + t`` (S = the batch's sessions, T = ``positions``) through every
        block: (the final norm's output (S T, d), the states after the last position)."""
        h = self._embed(inputs)  # (S T, d) float64
        xn = launch.rms_norm(h, self.layers[0].norm, self.eps)
        conv, ssm = [], []
        for i, layer in enumerate(self.layers):
            delta, new_conv, new_ssm = layer.mix(xn, batch.conv[i], batch.ssm[i], positions)
            conv.append(new_conv)
            ssm.append(new_ssm)
            norm = self.layers[i + 1].norm if i + 1 < len(self.layers) else self.norm_f
            xn = launch.rms_norm(h, norm, self.eps, delta)  # h += delta, then the norm
        return xn, DeviceBatch(tuple(conv), tuple(ssm))

    def _embed(self, inputs: torch.Tensor) -> torch.Tensor:
        """The residual stream's first value per row (M, d) float64, rows contiguous
        (exact copies of float32 rows, or the input projection's output)."""
        if self.input_proj is not None:
            return launch.product(inputs, self.input_proj).to(torch.float64)
        if self.embeddings is not None:
            return self.embeddings.index_select(0, inputs).to(torch.float64)
        # The tied head's rows: (d, M) columns, transposed into rows the kernels read.
        return self.head.w_t.index_select(1, inputs).t().contiguous().to(torch.float64)

    # ------------------------------------------------------------------ prefill and run

    def prefill(
        self,
        inputs: np.ndarray,
        state: SessionState | None = None,
        outputs: OutputRows = "all",
        helpers: Sequence[Executor] | None = None,
    ) -> tuple[np.ndarray, SessionState]:
        """One session through ``inputs`` (T,) ids or (T, i) with the bits of T steps:
        products over all positions at once, the conv and the scan position by position
        (the step's kernels with T positions), the head only on the rows ``outputs``
        names ("all", "last", "none", a mask or increasing indices). ``helpers`` is the
        CPU engine's (its runner threads): unused, the device is the parallel part."""
        seq = self.check_inputs(inputs)
        start = state if state is not None else self.new_state()
        self.check_state(start)
        steps = seq.shape[0]
        rows = output_rows(outputs, steps)  # (m,)
        batch = DeviceBatch.from_host(BatchState.stack([start]), self.device)
        picked = []
        for lo in range(0, steps, CHUNK_ROWS):
            hi = min(steps, lo + CHUNK_ROWS)
            xn, batch = self._trunk(self._inputs(seq[lo:hi]), batch, positions=hi - lo)
            a, b = np.searchsorted(rows, (lo, hi))
            if b > a:
                picked.append(xn[torch.from_numpy(rows[a:b] - lo).to(self.device)])
        out = np.empty((0, self.config.output_dim), np.float32)
        if picked:
            out = launch.product(torch.cat(picked), self.head).cpu().numpy()
        final = batch.to_host().session(0).copy()
        return out, final

    def run(
        self, inputs: np.ndarray, state: SessionState | None = None
    ) -> tuple[np.ndarray, SessionState]:
        """Step one session through ``inputs`` one at a time (as ``MambaModel.run``)."""
        seq = self.check_inputs(inputs)
        batch = BatchState.stack([state if state is not None else self.new_state()])
        outputs = np.empty((seq.shape[0], self.config.output_dim), np.float32)
        for t in range(seq.shape[0]):
            batch, out = self.step(batch, seq[t : t + 1])
            outputs[t] = out[0]
        return outputs, batch.session(0)


def _check_supported(config: MambaConfig, name: str) -> None:
    """Refuse a model whose math the GPU engine does not compute (ModelFormatError)."""
    if config.mixer_rms_eps:
        raise ModelFormatError(
            f"model {name!r} is a FalconMamba (norms inside the mixer), which the GPU "
            f"engine does not compute: serve it with --engine cpu"
        )
    if config.input_normalization or config.output_normalization:
        raise ModelFormatError(
            f"model {name!r} normalises its signal (input_normalization / "
            f"output_normalization), which the GPU engine does not apply: serve it "
            f"with --engine cpu"
        )
