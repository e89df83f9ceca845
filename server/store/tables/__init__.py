"""The tables and the work on a table's groups: a lease's life (leases.py, the room's top), the
catalog (catalog.py, the tables and each one's extensions, above the rest), taking a batch
(taking.py), AReaL's admission bound, a table's migration, its integrity check, and browsing it.

May import the rooms below: ledger, rules, core, disk, schema.
"""
