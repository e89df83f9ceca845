"""expbuf server side: the LMDB store, the gRPC service with its interceptors (tokens, limits,
metrics), advantage estimators, configuration and the `expbuf` command line."""

from importlib.metadata import version

__version__ = version("expbuf")  # one source: the package metadata, as pip installed it
