"""The gRPC service, in rooms by role: the servicer (service.py), which mixes in the servicers of
its services (servicers/: reads, the prompt ledger, the off-policy bound, tables, keyed values); a
push's path (push/: its request read by hand, the memory pushes hold, their decoding, the
PushStream's pipeline); a Sample stream's (sample/: its conversation, replies serialised once,
sends a client stopped taking); the interceptors (interceptors/: their base, tokens, call limits,
metrics, unreadable requests); and
what every call shares (call_context.py), the end of open streams at a stop (draining.py) and the
writers' end of data (writers.py). app.py assembles them into a server.

Rooms import only downward: service over servicers/, over push/ and sample/, over the shared
modules, over interceptors/ (pyproject.toml). May import advantages, config and the
store; nothing above (app, cli, commands).
"""
