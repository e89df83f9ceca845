"""Deprecated: `expbuf.server.store.schema.estimator_registry` (client/moved.py)."""

from expbuf.client.moved import moved

from .schema import estimator_registry

__getattr__ = moved(__name__, estimator_registry)
