"""Deprecated: the orders' names are `expbuf.server.store`'s (client/moved.py)."""

from expbuf.client.moved import moved

from . import store

__getattr__ = moved(__name__, store)
