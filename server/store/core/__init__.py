"""The table core: the only code that reads and writes a table's records. A table inside one
transaction (state.py: its record cache, counters and ready index, and `save`), the events it
raises and the class a table's extensions subclass (events.py), the counters and their stored
form (counters.py), and what is checked of a payload before it leaves the store
(read_check.py), in that order of layers.

May import the rooms below: disk, schema. The rules and every room above reach a table's
records through it.
"""
