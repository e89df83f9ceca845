"""What the order registry holds, as names the rooms below it read: the orders a sample request
may name (sample_spec.py checks a request's order against them) and the databases of the indexes
the registered orders read (the store opens them, disk/layout.py).

The registry (`register`, `unregister` in core/ordering/orders.py) keeps both; nothing else writes them.
"""

from __future__ import annotations

# Every order's name, in the order error messages list them.
NAMES: list[str] = []
# The databases of the indexes of the registered orders and of the version index, in the order
# the registry lists those indexes.
DATABASES: tuple[str, ...] = ()


def kept(names: list[str], databases: tuple[str, ...]) -> None:
    """The registry's orders and their indexes' databases, after a registration changed them."""
    global DATABASES
    NAMES[:] = names
    DATABASES = databases
