"""A push as columns, the ColumnBatch payload: build.py (`ColumnBatch`, made from a rollout
worker's tensors), wire.py (the message written and read, with protobuf) and items.py (its
columns read into the same checked items a TRXP push makes, with no protobuf). The store never
imports this room; the server's ingest and the clients do.
"""
