"""The rules, functions over one table's state in one transaction, in layers: the group state
machine (groups.py), reuse and quarantine over capacity, staleness and the advantages a push
computes, over retirement, over the rate limiter, over the table extension hooks, over the
table state (table_state.py: record cache, counters, ready index), over the counters and the
check of a read.

May import the rooms below: disk, schema.
"""
