"""Whether the GPU engine can run here, and on which device.

Importable without torch or triton (only ``importlib`` looks for them), so the CLI can
refuse ``--engine cuda`` with a clear message before any kernel module is imported.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: What ``--engine cuda`` needs, and how to get it.
INSTALL_HINT = "install the GPU engine's packages: pip install 'ssmserve[cuda]' (torch, triton)"


def missing_packages() -> list[str]:
    """The GPU engine's packages (torch, triton) that are not importable here."""
    return [name for name in ("torch", "triton") if importlib.util.find_spec(name) is None]


def interpreted() -> bool:
    """True when Triton runs its kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_device() -> torch.device:
    """``cuda`` when a GPU is visible and Triton compiles for it; else ``cpu``, where the
    kernels run only under Triton's interpreter (set ``TRITON_INTERPRET=1`` before triton
    is first imported)."""
    import torch

    if torch.cuda.is_available() and not interpreted():
        return torch.device("cuda")
    if not interpreted():
        raise RuntimeError(
            "no CUDA device: the GPU engine runs on the CPU only under Triton's interpreter "
            "(TRITON_INTERPRET=1 set before triton is imported); small models only"
        )
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    """The device in words: the GPU's name and compute capability, or the interpreter."""
    import torch

    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"
    return "cpu triton-interpreter"
