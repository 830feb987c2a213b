"""The ssmserve worker. Sub-packages, one concept each; imports run one way, downwards:

``http``      the OpenAI-compatible HTTP edge (``--http``), on the same sessions as gRPC
``api``       the gRPC edge: servicers, typed errors -> status codes
``sessions``  hot sessions of one worker: residency, snapshots, rollback, batching
``cluster``   leases and fencing, the worker registry, migration and drain
``state``     checkpoint codec, input log, the Redis store (keys and Lua in one place)
``engine``    model math, kernels, loader (numpy and numba only)

``errors`` (typed errors with a kind) and ``observability`` are shared by all of them.

``worker``       one worker process: wires them together, starts and stops them in order
``main``         ``ssmserve-server``: settings and flags, embedded Redis, signals
``readiness``    the health of "" and the services: drained or not, the store's PING
``startup_checks``  refused at start: a taken port, an advertised address in use
``supervisor``   ``--workers N``: worker processes, their Redis, restarts, drain
``embedded_redis``  a private redis-server (the default store and the tests')
``embedded_redis_keeper``  starts it again from its AOF when it dies
``restart_backoff``  the bounded, exponential delays before a restart
``data_dir_lock``  one process per ``--data-dir`` (flock)
``advertise_lock``  one worker per address and data dir; proof its predecessors died
``parent_death``   child processes that end with their parent (Linux)
``cli``          the server-side commands of the ``ssmserve`` CLI (their flags)
``offline_commands``  what those commands do: the engine and the token file, offline
``export``       a signal model trained in PyTorch -> a model directory (``ssmserve[torch]``)
"""

__version__ = "0.1.0"
