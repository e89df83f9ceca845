"""The command line's tools: clients of a running server through the RPCs, `expbuf table`
(tables.py), `expbuf dataset` (datasets.py), `expbuf export` (export.py) and `expbuf stats`
(stats.py), whose exports go through out_file.py; and a data directory's own, `expbuf check`,
`repair` and `backup` (datadir.py), through the store's face. `CommandError` is any tool's refusal,
which the command line says in one line.

May import the client, config and the store's face; nothing of the server's running parts.
"""


class CommandError(Exception):
    """A command cannot run; the message names the cause in one line."""
