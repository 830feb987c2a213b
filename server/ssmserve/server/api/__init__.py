"""The gRPC edge: servicers, request validation, and typed errors -> status codes.

``status``           the one place where ``SsmserveError`` kinds become gRPC codes and details
``service``          ``SessionService``
``cluster_service``  ``ClusterService`` (workers, migrate, drain, adopt)

Imports: everything below it (``sessions``, ``cluster``, ``state``, ``engine``).
"""
