"""ssmserve server: the numpy SSM engine, checkpoint codec and (later) the gRPC worker."""

__version__ = "0.1.0"
