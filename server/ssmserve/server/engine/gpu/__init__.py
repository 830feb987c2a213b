"""The GPU engine: the same models on fixed-order Triton kernels (``--engine cuda``).

Every output element is summed in one order whatever the batch size, the row's position
and whether its step came from a prompt or from decoding, so the exactness promises
(replay, rollback, migration) hold on a GPU as on the CPU engine. Optional: it needs the
``cuda`` extra (torch, triton); nothing else imports it, and the CPU engine stays the
default. Without a GPU its kernels run under Triton's interpreter (``TRITON_INTERPRET=1``)
on small models, which is how CI tests them.

``runtime``   whether torch / triton are installed (checked without importing them), the
              device, the interpreter
``kernels``   the Triton kernels: product, norms, conv, Mamba-1 scan, Mamba-2 SSD scan
``launch``    their Python side: grids, shapes, the device weight of a product
``layers``    one block's weights on the device and its mixer over sessions x positions
``model``     ``GpuMambaModel``: load, step, prefill, run; states as the CPU engine's
``graphs``    decode steps replayed as CUDA graphs, one per batch-size bucket
``numerics``  the signature naming the engine, device, versions and this package's source

Imports: torch and triton (every module but ``runtime``), and the engine's config,
loader, state and prefill helpers.
"""
