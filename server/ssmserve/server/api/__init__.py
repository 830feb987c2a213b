"""The gRPC edge: servicers, request validation, and typed errors -> status codes.

``status``           the one place where ``SsmserveError`` kinds become gRPC codes and details
``service``          ``SessionService``: the handlers of the session RPCs
``stream_pipeline``  Stream: requests read ahead, steps queued as runs, answers in order
``generate_calls``   Generate: a request checked and started, its tokens sent as drawn
``output_rules``     Generate's constraint and text monitor from the proto; retractions out
``answer_fence``     the last check as an answer leaves: is its session's lease still sure?
``conversions``      protobuf messages <-> the server's types (configs, infos, results)
``cluster_service``  ``ClusterService`` (workers, migrate, drain, undrain, adopt)
``auth``             bearer tokens, roles, the authorization interceptor, the cluster secret
``tenancy``          session ids per tenant (``tenant~id`` in the store)
``budgets``          per-tenant and per-worker budgets (sessions, imports, forecasts)
``tls``              TLS / mTLS on the listener, certificates reloaded when they change
``imports``          ImportCheckpoint streams staged in Redis as they arrive
``rpc_metrics``      the interceptor that times every RPC by method and status code
``heartbeats``       proof of life in slow server-streaming replies
``serving_gate``     every SessionService call refused while the worker must not serve

Imports: everything below it (``sessions``, ``cluster``, ``state``, ``engine``).
"""
