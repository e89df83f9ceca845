"""Deprecated: `expbuf.server.store.schema.states` (client/moved.py)."""

from expbuf.client.moved import moved

from .schema import states

__getattr__ = moved(__name__, states)
