"""The GPU engine's numerics signature: what its bits depend on besides weights and inputs.

Two workers with the same signature give the same bits for the same weights and inputs;
a session recorded under one signature never replays under another (the CPU engine's
signature, ``engine/numerics.py``, differs from every one of these: it names no
``engine=triton``). The kernels' bits depend on the device (its exp/log, its compiler
target), the torch and triton versions (the compiler) and the kernels' own source.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import triton

from ssmserve.server.engine.gpu.runtime import device_name


def gpu_source_digest() -> str:
    """sha256 of every module of this package, in name order, hex."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def gpu_numerics_description(device: torch.device) -> str:
    """One line: the engine, the device, the torch / triton versions and the source hash."""
    return (
        f"engine=triton device={device_name(device)} | torch {torch.__version__}"
        f" triton {triton.__version__} | gpu {gpu_source_digest()[:12]}"
    )


def gpu_numerics_signature(device: torch.device) -> str:
    """A short hash of :func:`gpu_numerics_description`: equal signatures, equal bits."""
    return hashlib.sha256(gpu_numerics_description(device).encode()).hexdigest()[:16]
