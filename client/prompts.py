"""Deprecated: `expbuf.client.schema.prompts` (moved.py)."""

from .moved import moved
from .schema import prompts

__getattr__ = moved(__name__, prompts)
