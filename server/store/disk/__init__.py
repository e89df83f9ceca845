"""What is on disk and how: the LMDB environment with its single writer (environment.py), the
named databases and keys (layout.py), the records and their binary form (records.py), what goes
in and comes out (kinds.py), snapshots, batch rows, digests, residency (RSS kept small) and the
stored forms of advantages.

May import the room below: schema.
"""
