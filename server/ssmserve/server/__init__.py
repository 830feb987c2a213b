"""The ssmserve worker. Sub-packages, one concept each; imports run one way, downwards:

``api``       the gRPC edge: servicers, typed errors -> status codes
``sessions``  hot sessions of one worker: residency, snapshots, rollback, batching
``cluster``   leases and fencing, the worker registry, migration and drain
``state``     checkpoint codec, input log, the Redis store (keys and Lua in one place)
``engine``    model math, kernels, loader (numpy and numba only)

``worker`` wires them together; ``main`` is ``ssmserve-server`` (settings, embedded
Redis, signals); ``cli`` adds the server-side commands to the ``ssmserve`` CLI.
"""

__version__ = "0.1.0"
