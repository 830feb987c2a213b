"""Hot sessions of one worker: residency, snapshots, rollback and replay, guards, batching.

``session``          one resident session (state, step, history, lease) and its lock
``config``           per-session settings (durability, snapshot period, guards, idle TTL)
``guards``           rules on every output (FINITE, RANGE) and their actions
``stepper``          gathers queued steps of many sessions into one engine call per tick
``snapshot_writer``  periodic checkpoints encoded and written off the hot path
``forecaster``       forecasts of many sessions batched per engine call
``manager``          ``SessionManager``: the session operations the API calls

Imports: ``cluster``, ``state`` and ``engine``; never gRPC.
"""
