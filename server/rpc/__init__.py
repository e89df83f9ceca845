"""The gRPC service: the servicer (service.py), its streams (push_stream.py, sample_stream.py),
the prompt ledger's calls (ledger_service.py), replies serialised once, what pushes hold in
memory and their decoding (push_memory.py, inflight.py, push_request.py, ingest.py), the
interceptors (auth, limits, metrics), what every call shares (call_context.py), the end of open
streams at a stop and the writers' end of data.

May import advantages, backend, config and the store; nothing above (app, cli, commands).
"""
