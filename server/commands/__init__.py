"""The command line's tools, clients of a running server through the RPCs: `expbuf table`
(tables.py), `expbuf dataset` (datasets.py), `expbuf export` (export.py) and `expbuf stats`
(stats.py).

May import the client and config; nothing of the server's running parts.
"""
