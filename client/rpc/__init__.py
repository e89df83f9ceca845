"""The wire between a client and one server: channels, calls, statuses and replies.

`connection.py` (TLS, channels, the retry policy), `calls.py` (what each call sends and how its
reply is read, for both clients; the reads of named experiences in `read_calls.py`, the prompt
ledger's calls in `ledger_calls.py`), `aio_status.py` (how a grpc.aio stream ended), `sample_reply.py`
and `sample_spec.py` (a Sample's request and reply), `wire.py` (the proto's enums and a table's
settings as messages). This room imports grpc and protobuf, `schema/` and the codec, never the
clients above it.
"""
