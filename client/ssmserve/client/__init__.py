"""ssmserve client: the command-line interface (and, with the service, the client library)."""
