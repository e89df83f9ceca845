"""The ready groups in their orders, at the bottom of the table core: `ReadyIndex`, a table's
ready indexes kept for the registered orders and the builds of those it lacks (ready.py), over
the orders, one registered `Order` class each, and their registry (orders.py), over the
ready-group indexes, one `Index` class each owning its LMDB databases (indexes.py).

Imports nothing of the core's outside this room.
"""
