"""The SSM engine: numpy only, no I/O beyond reading a model directory.

``config``    what a model is (dims, architecture), parsed from ``config.json``
``numerics``  the BLAS settings and the batch-invariant matrix product
``mamba``     the math: one recurrent step of a stack of Mamba blocks, batched
``loader``    Hugging Face ``MambaForCausalLM`` and signal-Mamba directories
``demo``      a deterministic random signal Mamba for demos and tests
"""

from server.model.config import Architecture, MambaConfig
from server.model.loader import load_model, save_model
from server.model.mamba import MambaModel

__all__ = ["Architecture", "MambaConfig", "MambaModel", "load_model", "save_model"]
