"""expbuf server side: the LMDB store, the gRPC service with its interceptors (tokens, limits,
metrics), advantage estimators, configuration and the `expbuf` command line."""

from importlib.metadata import version

from expbuf.client.moved import serve

__version__ = version("expbuf")  # one source: the package metadata, as pip installed it

# The old paths of the server's modules that moved (the order registry's names into the store's
# face; the rest into the rooms), each served with no file until the next release: every name
# read from one is the new module's, with a DeprecationWarning (client/moved.py; CHANGELOG.md).
OLD_PATHS = {
    "expbuf.server.estimator_registry": "expbuf.server.store.schema.estimator_registry",
    "expbuf.server.ready_indexes": "expbuf.server.store",
    "expbuf.server.selection": "expbuf.server.store",
    "expbuf.server.estimators": "expbuf.server.advantages.estimators",
    "expbuf.server.batch_stage": "expbuf.server.advantages.batch_stage",
    "expbuf.server.shaping": "expbuf.server.advantages.shaping",
    "expbuf.server.store.selection": "expbuf.server.store",
    "expbuf.server.store.ready_indexes": "expbuf.server.store",
    "expbuf.server.store.schema.selection": "expbuf.server.store",
    "expbuf.server.store.schema.ready_indexes": "expbuf.server.store",
    "expbuf.server.store.estimator_registry": "expbuf.server.store.schema.estimator_registry",
    "expbuf.server.store.table_config": "expbuf.server.store.schema.table_config",
    "expbuf.server.store.table_parts": "expbuf.server.store.schema.table_parts",
    "expbuf.server.store.errors": "expbuf.server.store.schema.errors",
    "expbuf.server.store.states": "expbuf.server.store.schema.states",
    "expbuf.server.store.sample_spec": "expbuf.server.store.schema.sample_spec",
    "expbuf.server.store.stored_advantages": "expbuf.server.store.disk.stored_advantages",
    "expbuf.server.rpc.stalled_sends": "expbuf.server.rpc.sample.stalled_sends",
}
serve(OLD_PATHS)
