"""What a session is made of, at rest: the checkpoint codec, the input log, and Redis.

``checkpoint``    immutable, versioned, checksummed binary record of a session at a step
``checkpoint_signing``  an HMAC trailer on exported checkpoints (proof of origin)
``input_log``     the encoding of logged inputs and the history window a checkpoint carries
``lease``         the fencing token every store write carries (``SessionLease``)
``store_layout``  every Redis key and Lua script, in one place
``store_errors``  the typed error replies of those scripts, and the exceptions they map to
``store``         the Redis I/O itself (``Store``), one method per script
``script_batches``  one script for many sessions in one round trip (per node on a cluster)
``redis_topology``  redis://, redis+cluster:// and redis+sentinel:// URLs and their clients

Imports: ``engine`` only (never gRPC, never the session manager).
"""
