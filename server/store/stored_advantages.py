"""Deprecated: `expbuf.server.store.disk.stored_advantages` (client/moved.py)."""

from expbuf.client.moved import moved

from .disk import stored_advantages

__getattr__ = moved(__name__, stored_advantages)
