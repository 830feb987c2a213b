"""Decode steps replayed as CUDA graphs, one per batch-size bucket.

Why: an eager step launches about nine kernels per layer, and at batch 1 the launches, not
the arithmetic, set its time (24 layers: ~200 launches). A CUDA graph replays all of them
in one call. A graph runs on fixed buffers of fixed shape, so a batch of b sessions runs in
the graph of the smallest bucket >= b (:data:`BUCKETS`): its rows :b hold the batch, the
rows past b hold whatever an earlier batch left there. That changes no bit of rows :b:
every kernel computes each row from that row alone (batch invariance, the engine's
promise, tested at every batch size), and the rows past b are never read back.

Batches above the largest bucket run eagerly: there the launches are a small part of the
step. Without a GPU (Triton's interpreter) the same padding runs eagerly, so the tests
exercise everything here but the capture itself; ``bench/tools/gpu_check.py`` checks on the
device that a replay gives the eager step's bits.

Glossary: b sessions in the batch, B its bucket (b <= B).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: Batch sizes with a graph of their own; a batch runs in the smallest bucket that holds it.
#: Capped at 64: a bucket holds its states twice (in and out) on the device, 2 x 64 x 19.5
#: MB = 2.5 GB at mamba2-130m's shapes, and above 64 rows the launches are a small part.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class GraphBuffers:
    """One bucket's static buffers: what the graph reads and what it writes."""

    rows: int
    inputs: torch.Tensor  # (B,) ids or (B, i)
    conv: tuple[torch.Tensor, ...]  # per layer (B, c, k)
    ssm: tuple[torch.Tensor, ...]  # per layer (B, e, n) | (B, h, p, n)
    replay: Callable[[], None] | None = None  # None: run eagerly (no GPU)
    out: torch.Tensor | None = None  # (B, o), written by the replay
    conv_out: tuple[torch.Tensor, ...] = ()
    ssm_out: tuple[torch.Tensor, ...] = ()


def bucket_for(rows: int) -> int | None:
    """The smallest bucket that holds ``rows`` sessions, or None above the largest."""
    return next((size for size in BUCKETS if size >= rows), None)


StepFn = Callable[
    [tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor],
    tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor],
]


class StepGraphs:
    """Steps of a batch through the graph of its bucket (captured on first use)."""

    def __init__(self, step: StepFn, device: torch.device, template: GraphBuffers) -> None:
        """``step(conv, ssm, inputs) -> (new conv, new ssm, outputs)`` is the eager step on
        device tensors; ``template`` a one-row bucket giving each buffer's shape and dtype."""
        self._step = step
        self._device = device
        self._template = template
        self._buckets: dict[int, GraphBuffers] = {}

    def step(
        self, conv: tuple[torch.Tensor, ...], ssm: tuple[torch.Tensor, ...], inputs: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor]:
        """The step of ``b`` sessions: (new conv, new ssm, outputs), each with b rows."""
        b = inputs.shape[0]
        size = bucket_for(b)
        if size is None:
            return self._step(conv, ssm, inputs)
        bucket = self._buckets.get(size) or self._make(size)
        bucket.inputs[:b].copy_(inputs)
        for static, value in zip(bucket.conv + bucket.ssm, conv + ssm, strict=True):
            static[:b].copy_(value)
        if bucket.replay is None:  # no GPU: the same padded rows, eagerly
            new_conv, new_ssm, out = self._step(bucket.conv, bucket.ssm, bucket.inputs)
        else:
            bucket.replay()
            new_conv, new_ssm, out = bucket.conv_out, bucket.ssm_out, bucket.out
            assert out is not None
        # Copies: the next replay overwrites the graph's outputs.
        return (
            tuple(t[:b].clone() for t in new_conv),
            tuple(t[:b].clone() for t in new_ssm),
            out[:b].clone(),
        )

    def _make(self, size: int) -> GraphBuffers:
        t = self._template

        def rows(x: torch.Tensor) -> torch.Tensor:  # (1, ...) -> (B, ...) zeros
            return torch.zeros((size, *x.shape[1:]), dtype=x.dtype, device=self._device)

        bucket = GraphBuffers(
            size, rows(t.inputs), tuple(rows(x) for x in t.conv), tuple(rows(x) for x in t.ssm)
        )
        if self._device.type == "cuda":
            self._capture(bucket)
        self._buckets[size] = bucket
        return bucket

    def _capture(self, bucket: GraphBuffers) -> None:
        """Record the step on the bucket's buffers as a CUDA graph: first a few eager runs
        on a side stream (Triton compiles, the allocator settles), then the capture."""
        stream = torch.cuda.Stream(self._device)
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(bucket.conv, bucket.ssm, bucket.inputs)
        torch.cuda.current_stream(self._device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            conv_out, ssm_out, out = self._step(bucket.conv, bucket.ssm, bucket.inputs)
        bucket.conv_out, bucket.ssm_out, bucket.out = conv_out, ssm_out, out
        bucket.replay = graph.replay
