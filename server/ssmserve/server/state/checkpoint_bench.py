"""``ssmserve model bench DIR --checkpoint``: the checkpoint codec on a state of a model's
shapes, beside a plain memory copy of the same bytes.

A snapshot, a migration and a rollback each encode or decode one checkpoint; what that
costs depends on the state's shapes alone, so this reads only the model's config (no
weights). The state is random float32 in the packed form a periodic snapshot holds, with
a 64-input history. Encode copies the state's bytes once and hashes them; the copy of the
same bytes into a new buffer, timed in the same run, is its floor (``memcpy_ms``). Format 1
(sha256) is timed beside format 2 (xxh3_128).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from ssmserve.server.engine.config import MambaConfig
from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.state.checkpoint import FORMAT_VERSION, Checkpoint, InputHistory

#: Timed rounds of each operation (the median is reported), after ``WARMUP`` untimed ones.
ROUNDS = 50
WARMUP = 3
HISTORY = 64


@dataclass(frozen=True)
class CheckpointBenchResult:
    """Medians of ``rounds`` runs, in milliseconds; ratios are over ``memcpy_ms``."""

    model: str
    format_version: int  # what encode_ms and decode_ms measure (writers' default)
    state_bytes: int
    blob_bytes: int
    rounds: int
    encode_ms: float
    decode_ms: float
    memcpy_ms: float  # the state's bytes copied into a new buffer, same run
    encode_over_memcpy: float
    decode_over_memcpy: float
    format1_encode_ms: float
    format1_decode_ms: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def bench_checkpoint(config: MambaConfig, name: str, rounds: int = ROUNDS) -> CheckpointBenchResult:
    """Time encode and decode of a checkpoint of ``config``'s state shapes."""
    ckpt = random_checkpoint(config, name)
    buffer = ckpt.state.packed_buffer()
    assert buffer is not None
    blob, blob1 = ckpt.encode(), ckpt.encode(format_version=1)
    ms = _medians_ms(
        {
            "memcpy": buffer.tobytes,
            "encode": ckpt.encode,
            "decode": lambda: Checkpoint.decode(blob),
        },
        rounds,
    )
    # apart: sha256's passes over other buffers would evict the bytes the others reuse
    ms |= _medians_ms(
        {
            "encode1": lambda: ckpt.encode(format_version=1),
            "decode1": lambda: Checkpoint.decode(blob1),
        },
        rounds,
    )
    return CheckpointBenchResult(
        model=name,
        format_version=FORMAT_VERSION,
        state_bytes=buffer.nbytes,
        blob_bytes=len(blob),
        rounds=rounds,
        encode_ms=ms["encode"],
        decode_ms=ms["decode"],
        memcpy_ms=ms["memcpy"],
        encode_over_memcpy=ms["encode"] / ms["memcpy"],
        decode_over_memcpy=ms["decode"] / ms["memcpy"],
        format1_encode_ms=ms["encode1"],
        format1_decode_ms=ms["decode1"],
    )


def random_checkpoint(config: MambaConfig, name: str, seed: int = 0) -> Checkpoint:
    """A checkpoint at step ``HISTORY`` of a random packed state of ``config``'s shapes."""
    rng = np.random.default_rng(seed)
    size = config.state_bytes // 4
    state = SessionState.unpacked(
        rng.standard_normal(size, dtype=np.float32),
        config.num_hidden_layers,
        config.conv_state_shape,
        config.ssm_state_shape,
    )
    if config.is_token_model:
        inputs = rng.integers(0, config.vocab_size, HISTORY)
    else:
        inputs = rng.standard_normal((HISTORY, config.input_dim), dtype=np.float32)
    return Checkpoint("bench", HISTORY, name, "0" * 64, state, InputHistory(1, inputs))


def _medians_ms(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each run's median time: the runs take turns within every round, so a neighbour's
    load on a shared machine falls on all of them alike."""
    for _ in range(WARMUP):
        for run in runs.values():
            run()
    seconds = {name: np.empty(rounds) for name in runs}
    for i in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[name][i] = time.perf_counter() - start
    return {name: float(np.median(s) * 1e3) for name, s in seconds.items()}
