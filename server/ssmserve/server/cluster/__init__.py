"""Workers that share a Redis: ownership, the worker registry, peers and the store's guard.

``ownership``    lease keeping (renewal, revalidation) and the worker registry heartbeat
``takeover``     when a lease its owner never let go may be taken over
``peers``        deadline-bound gRPC channels to other workers
``store_guard``  the store's eviction policy and identity, watched

Imports: ``state`` and ``engine``. Moving sessions between workers (migration, drain,
rebalancing) drives the session code, so it lives above this package, in ``sessions``.
"""
