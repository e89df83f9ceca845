"""The wire between a client and one server: channels, calls, statuses and replies.

`connection.py` (TLS, channels, the retry policy), `declare.py` (a call declared once for the four
clients: what it sends, how its reply is read, how the sharded clients route it, and each client's
method made of it; `mypy_names.py`, a mypy plugin, names those methods in mypy's messages),
`api.py` (the calls the clients inherit), `calls/` (the calls as the clients make them: each
declared in the module of its kind, a call made again after a busy refusal, the Sample stream's
pieces), `aio_status.py` (how a grpc.aio stream ended), `sample_reply.py` and
`sample_spec.py` (a Sample's request and reply), `wire.py` (the proto's enums and a table's
settings as messages). This room imports grpc and protobuf, `schema/` and the codec, never the
clients above it (a route names the sharded clients' plans as a type only: declare.py).
"""
