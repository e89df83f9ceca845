"""The service's calls as the clients make them, a module a job; the package exports what the
clients, their pushers and the sharded clients read of them (`from .rpc import calls`).

Each call is declared once (rpc/declare.py), in the module of its kind: a push, with its payload
and messages (`push_calls.py`); leases ended, renewed, groups retired (`lease_calls.py`); trainer
versions and admission (`admission_calls.py`); pending groups settled without a push: runs
failed, a group sealed (`group_calls.py`); tables created, listed, dropped, and deletes
(`table_calls.py`); stats and the server's info (`info_calls.py`); reads of named experiences
(`read_calls.py`); keyed values (`value_calls.py`); the prompt ledger (`ledger_calls.py`).
rpc/api.py gathers them into the classes the clients inherit. Beside them, what both clients'
runners make of a call: an attempt made again after a refusal that did nothing (`attempts.py`), a
call retried only where its server answers it again as the first (`repeats.py`), and the Sample
stream's pieces (`sample_stream.py`).
"""

from .attempts import LAST_UNANSWERED, Attempts, one_reply
from .push_calls import Items, payload, payload_uids, push, push_requests, push_result
from .repeats import Repeats
from .sample_stream import (
    STOP_SECONDS,
    Deliveries,
    Handing,
    HeldBack,
    Orders,
    batch,
    confirm_by,
    confirmation,
    ended_late,
    finished,
    handed,
    unanswered,
)

__all__ = [
    "LAST_UNANSWERED",
    "STOP_SECONDS",
    "Attempts",
    "Deliveries",
    "Handing",
    "HeldBack",
    "Items",
    "Orders",
    "Repeats",
    "batch",
    "confirm_by",
    "confirmation",
    "ended_late",
    "finished",
    "handed",
    "one_reply",
    "payload",
    "payload_uids",
    "push",
    "push_requests",
    "push_result",
    "unanswered",
]
