"""The orders a sample names: the built-in ones, which every server has, and the form of a name
that an order is registered under on a server (server/store/schema/selection.py), which a client
checks a name against before it asks the server which orders it has."""

from __future__ import annotations

import re

BUILT_IN = ("fifo", "lifo", "uniform", "priority")
NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")  # a registered order's name
NAME_FORM = "lower case letters, digits and _, a letter first, at most 64"


def order_problem(order: object) -> str | None:
    """What is wrong with `order` as an order's name, naming what it may be; None for a built-in
    order or a name that a server may have registered."""
    if isinstance(order, str) and (order in BUILT_IN or NAME.fullmatch(order)):
        return None
    return (
        f"order is {str(order)[:70]!r}; expected one of {', '.join(BUILT_IN)}, or the name of an order "
        f"registered on the server ({NAME_FORM})"
    )
