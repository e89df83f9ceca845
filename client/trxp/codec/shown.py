"""Untrusted values described in refusal messages: in bounded length and time, whatever a
payload holds, so that a hostile value cannot make its own refusal slow or huge.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .common import CONTAINERS, MAX_SHOWN


def is_int(value: Any) -> bool:
    """Whether a value is an int and not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def clip(text: str) -> str:
    """Untrusted text cut for an error message, with its full length."""
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}… ({len(text)} chars)"


def show(value: Any) -> str:
    """An untrusted value rendered for an error message in bounded length and time."""
    if isinstance(value, str):
        return repr(value) if len(value) <= MAX_SHOWN else f"{value[:MAX_SHOWN]!r}… ({len(value)} chars)"
    if isinstance(value, bytes):
        return repr(value) if len(value) <= MAX_SHOWN else f"{value[:MAX_SHOWN]!r}… ({len(value)} bytes)"
    if is_int(value) and value.bit_length() > 128:
        return f"an int of {value.bit_length()} bits"  # its decimal form would take quadratic time
    if isinstance(value, (int, float, type(None))):
        return repr(value)
    if isinstance(value, CONTAINERS):
        return f"a {type(value).__name__} of {len(value)} entries"
    return f"a {type(value).__name__}"


def show_list(values: Sequence[Any]) -> str:
    """A list of untrusted values rendered for an error message: its first eight, each shown."""
    shown = ", ".join(show(v) for v in values[:8])
    return f"[{shown}{', …' if len(values) > 8 else ''}]"


def item_where(index: int, uid: str) -> str:
    """How a message names an item, made only when a check fails."""
    return f"item {index} (uid {clip(uid)})"
