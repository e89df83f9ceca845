"""expbuf server side: the LMDB store, the gRPC service with its interceptors (tokens, limits,
metrics), advantage estimators, configuration and the `expbuf` command line."""
