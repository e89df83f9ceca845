"""The shapes both sides share, free of grpc, protobuf and torch: the server's store imports them.

A table's settings (`table_settings.py`) and presets (`table_presets.py`), an experience and its id
(`experience.py`), the prompt ledger's records as the clients return them (`prompts.py`), which
shard owns a group (`routing.py`), and a bearer token as both sides read it (`tokens.py`).
This room imports nothing of expbuf but the codec.
"""
