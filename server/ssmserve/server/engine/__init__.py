"""The SSM engine: numpy only, no I/O beyond reading a model directory.

``interface``  ``Engine``: what the serving code asks of an engine (both below implement it)
``config``    what a model is (dims, architecture), parsed from ``config.json``
``numerics``  the BLAS settings and the batch-invariant matrix product
``weights``   what the math reads: a block's weights (the mixers' protocol), a step's
              workspace, a whole model's weights and the checks of its inputs and states
``mamba1``    the Mamba-1 mixer (selective scan)
``mamba2``    the Mamba-2 mixer (multi-head SSD step, gated norm)
``mamba``     the math: one recurrent step of a stack of Mamba blocks, batched
              (``MambaModel``)
``model_tensors``  a model's tensors in any file format: names and shapes, fingerprint,
              the memory a load takes, and the model assembled from them
``loader``    Hugging Face ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` and signal-model
              directories (F32, F16, BF16, F64; sharded)
``gguf_model``  Mamba / Mamba-2 GGUF files as llama.cpp's ``convert_hf_to_gguf.py`` writes
              them (F32, F16, BF16, Q8_0), read with llama.cpp's ``gguf`` package
``gguf_tokenizer``  the tokenizer inside a GGUF, rebuilt as a ``tokenizers.Tokenizer``
``demo``      a deterministic random signal Mamba or Mamba-2 for demos and tests
``tokenizer``  a token model's Hugging Face ``tokenizer.json``, read by ``tokenizers``
``detokenizer``  the text each generated token adds, in whole characters
``presets``   language models at released checkpoints' shapes (random-weight stand-ins)
``kernels``   the fused numba loops between a step's products
``recurrent_state``  per-layer state arrays of one session, and of a batch
``prefill``   one session's run of T inputs, each layer's products over all T at once,
              with the bits of T steps
``lane``      one engine thread per model, shared by steps, forecasts and replays
``products``  the batch-invariant matrix product micro-kernel (LLVM IR)
``quantize``  8-bit weights: llama.cpp's Q8_0 blocks, quantised at load or read from a GGUF
``bench``     ``ssmserve model bench``: batched engine steps timed on this machine

``compile_cache``  numba's on-disk cache, keyed by the engine's source
``threads``   the engine's helper threads: row ranges and column ranges of a step
``split_step``  a small batch's whole stack in one compiled call per thread, work shared
              by columns, channels and heads (the faster of shared and alone, as measured)
``spin``      the spin barrier and the join those calls' threads meet at
``allocator``  freed heap pages kept for the next step, given back when idle
``machine_memory``  the memory this process may still take (MemAvailable, cgroup v2 limits)
``environment``  the engine's knobs read from the environment, each checked
``gpu``       the optional GPU engine (``--engine cuda``): the same models on fixed-order
              Triton kernels, with the same bits at every batch size and for prefill vs
              steps; needs the ``cuda`` extra and is imported only when a worker or a
              command runs it

Imports: nothing else of the server (numpy, numba, safetensors; tokenizers for a
model directory that has a ``tokenizer.json``; gguf for a GGUF file). Inside, they run
one way: ``weights`` and ``kernels`` -> the mixers -> ``split_step`` and ``prefill`` ->
``mamba`` -> ``model_tensors`` -> ``gguf_model`` and ``loader``.
"""

from ssmserve.server.engine.compile_cache import key_numba_cache

key_numba_cache()  # before any kernel is decorated (see compile_cache.py)

# The kernels' modules come after it on purpose (E402).
from ssmserve.server.engine.config import Architecture, MambaConfig  # noqa: E402
from ssmserve.server.engine.loader import load_model, save_model  # noqa: E402
from ssmserve.server.engine.mamba import MambaModel  # noqa: E402

__all__ = ["Architecture", "MambaConfig", "MambaModel", "load_model", "save_model"]
