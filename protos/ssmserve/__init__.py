"""Generated gRPC stubs for the ssmserve contract (see protos/ssmserve/v1/ssmserve.proto)."""
