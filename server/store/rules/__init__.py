"""The rules, functions over one table's state in one transaction, in layers: the group state
machine (a push's experiences joining their groups, pushes.py, over their life after, groups.py),
reuse and quarantine over capacity, staleness and the advantages a push computes, over
retirement, over the rate limiter and the partial rollouts, over the table extensions run
(extensions.py) and the keyed values' records.

May import the rooms below: core (the table state they are functions over), disk, schema.
"""
