"""What is on disk and how: the LMDB environment with its single writer, its readers and the data
directory's lock (environment/, a room of its own), the named databases and keys (layout.py), the
records and their binary form (records.py), what goes in and comes out (kinds.py), snapshots,
batch rows, digests, residency (RSS kept small) and the stored forms of advantages; and in rows/,
a room of its own, the rows a table will keep per batch of groups (issue 64), which only the
table core reads and writes.

May import the room below: schema.
"""
