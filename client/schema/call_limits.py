"""How many names one call may carry where the server's one writer works through them all in one
transaction, every other tenant's writes waiting: the uids and group ids of a Delete, a Retire
or a FailRuns, the keys of a PutValues or a ClearValues. The server refuses more, by name; the
clients send any number in calls of at most this many. So are the reads that name what they
read, which hold a thread and the memory of their names: the keys of a GetValues, the uids of
a Get or a ReadFields, and the rewards a ReportPrompts gives a prompt.

Without a bound, one request of a message's size (256 MiB by default) names some 15 million,
and a Delete of 5 million absent uids held every push 6.5 s. Deleting 4,096 stored 8 KB
experiences holds the writer about 0.15 s, retiring 4,096 groups 0.09 s; a key costs a keyed
value's put or clear a microsecond or two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

MAX_NAMES_PER_CALL = 4096  # uids or group ids of a Delete, a Retire or a FailRuns (each list)
MAX_KEYS_PER_CALL = 65_536  # keys of a PutValues, a ClearValues or a GetValues
MAX_READ_UIDS = (
    65_536  # uids of a Get or a ReadFields, task ids and uids of a GetPartials (a batch holds at most as many)
)
MAX_REWARDS = 65_536  # rewards of one prompt a ReportPrompts gives (its runs')
# The most batches a sample stream may have sent ahead of its client's confirmations: what the
# server prepares ahead of its client, whatever gRPC's flow-control window would hold.
MAX_WINDOW = 8
# The reads whose one reply may be as large as a message: the server bounds what their replies
# hold until their clients take them, and refuses one past it as busy (server/rpc/interceptors/
# reply_memory.py); the clients make a read so refused again within its deadline.
LARGE_REPLIES = frozenset({"Get", "GetPartials", "ReadPartials", "GetValues", "ListExperiences", "ListPrompts"})
# A lease longer than a week is a forgotten batch, not a long training step.
MAX_LEASE_SECONDS = 7 * 86400.0


def in_parts(names: Sequence[T], most: int) -> list[Sequence[T]]:
    """`names` in order, in parts of at most `most` (one part, empty, for none: the call is made once)."""
    return [names[start : start + most] for start in range(0, len(names), most)] or [names[:0]]
