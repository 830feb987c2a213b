"""Workers that share a Redis: ownership, the worker registry, migration and drain.

``ownership``    lease keeping (renewal, revalidation) and the worker registry heartbeat
``takeover``     when a lease its owner never let go may be taken over
``peers``        deadline-bound gRPC channels to other workers
``migration``    Migrate one session, Drain a whole worker (through ``HandOffs``)
``rebalance``    sessions spread over the workers as they join
``store_guard``  the store's eviction policy and identity, watched

Imports: ``state`` and ``engine``; the session manager is reached only through the
``HandOffs`` protocol it implements, so this package never imports ``sessions``.
"""
