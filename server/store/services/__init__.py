"""The store's services, the façade's (engine.py) workers: sampling (sample, ack, nack),
pushing, reads, claims (the prompt ledger's calls), upkeep (expiries, timeouts, pruning), the
scrub, the background builds of lazy indexes (index_builds.py, below the others), and the
rollouts held in pieces that pushes put together off the writer (assembly.py, below pushing).

May import the rooms below: tables, ledger, rules, disk, schema.
"""
