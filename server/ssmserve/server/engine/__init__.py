"""The SSM engine: numpy only, no I/O beyond reading a model directory.

``config``    what a model is (dims, architecture), parsed from ``config.json``
``numerics``  the BLAS settings and the batch-invariant matrix product
``mamba``     the math: one recurrent step of a stack of Mamba blocks, batched
``loader``    Hugging Face ``MambaForCausalLM`` and signal-Mamba directories
``demo``      a deterministic random signal Mamba for demos and tests
``kernels``   the fused numba loops between a step's products
``recurrent_state``  per-layer state arrays of one session, and of a batch
``lane``      one engine thread per model, shared by steps, forecasts and replays

Imports: nothing else of the server (numpy, numba, safetensors only).
"""

from ssmserve.server.engine.config import Architecture, MambaConfig
from ssmserve.server.engine.loader import load_model, save_model
from ssmserve.server.engine.mamba import MambaModel

__all__ = ["Architecture", "MambaConfig", "MambaModel", "load_model", "save_model"]
