"""The table core: the only code that reads and writes a table's records. In layers: the rate
limiter's counts (rate_counts.py), over a table inside one transaction (state.py: its record
cache, counters and ready index, and `save`), over its ready indexes and their builds (ready.py),
over the orders and their registry (orders.py), over the ready-group indexes (indexes.py), over
the events the state raises with the class a table's extensions subclass (events.py), the
counters and their stored form (counters.py), and what is checked of a payload before it leaves
the store (read_check.py).

May import the rooms below: disk, schema. The rules and every room above reach a table's
records through it.
"""
