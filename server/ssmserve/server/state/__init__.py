"""What a session is made of, at rest: the checkpoint codec, the input log, and Redis.

``checkpoint``    immutable, versioned, checksummed binary record of a session at a step
``checkpoint_bench``  ``model bench --checkpoint``: the codec timed beside a memory copy
``checkpoint_signing``  an HMAC trailer on exported checkpoints (proof of origin)
``input_log``     the encoding of logged inputs and the history window a checkpoint carries
``lease``         the fencing token every store write carries (``SessionLease``)
``store_layout``  every Redis key and Lua script, in one place
``store_errors``  the typed error replies of those scripts, and the exceptions they map to
``session_ids``   what a session id may be, as a client gives it and as stored
``store_records`` the records in Redis hashes (session metadata, workers, snapshots)
``store``         ``Store``: sessions, leases, the worker registry, input logs, events
``store_leases``  leases taken, renewed, released, reserved for a hand-off and taken
                  back, and their holder (``Store`` has them)
``snapshot_store``  snapshot commit (two phases), reads, retention (``Store`` has them)
``import_staging``  ImportCheckpoint's chunks staged in Redis (``Store`` has them)
``store_facts``   the store's identity, eviction policy and replicas, and their reads
``store_calls``   the rules every store call follows: deadline, unknown outcomes, fencing
``script_batches``  one script for many sessions in one round trip (per node on a cluster)
``held_connection``  one connection held for a lone session's appends
``redis_topology``  redis://, redis+cluster:// and redis+sentinel:// URLs and their clients

Imports: ``engine`` only (never gRPC, never the session manager).
"""
