"""Deprecated: `expbuf.server.store.schema.sample_spec` (client/moved.py)."""

from expbuf.client.moved import moved

from .schema import sample_spec

__getattr__ = moved(__name__, sample_spec)
