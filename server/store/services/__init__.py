"""The store's services, the façade's (engine.py) workers: sampling (sample, ack, nack),
pushing, reads, claims (the prompt ledger's calls), upkeep (expiries, timeouts, pruning), the
scrub, and the background builds of lazy indexes (index_builds.py, below the others).

May import the rooms below: tables, ledger, rules, disk, schema.
"""
