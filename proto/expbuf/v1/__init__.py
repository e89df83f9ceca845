"""Generated code of the expbuf.v1 wire contract (see proto/generate.py)."""
