"""Workers that share a Redis: ownership, the worker registry, migration and drain.

``ownership``  lease keeping (renewal, revalidation) and the worker registry heartbeat
``peers``      deadline-bound gRPC channels to other workers
``migration``  Migrate one session, Drain a whole worker (through ``HandOffs``)

Imports: ``state`` and ``engine``; the session manager is reached only through the
``HandOffs`` protocol it implements, so this package never imports ``sessions``.
"""
