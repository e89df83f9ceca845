"""The calls of the clients, each declared once (rpc/declare.py), as the classes they inherit.

`Calls` is every call the four clients share: BufferClient, AsyncBufferClient and the two sharded
clients inherit it, each with its runner (client.py, aio.py, shards/). `ServerCalls` adds the calls
only a client of one server makes: a table's writers, and its experiences paged in insertion order;
`ShardCalls` the sharded clients' own: each shard's stats.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from expbuf.proto.v1 import buffer_pb2 as pb

from ..results import ExperiencePage, ListedExperience
from .calls.admission_calls import AdmissionCalls
from .calls.group_calls import GroupCalls
from .calls.info_calls import InfoCalls
from .calls.lease_calls import LeaseCalls
from .calls.ledger_calls import PromptCalls
from .calls.push_calls import PushCalls
from .calls.read_calls import ExperienceReads
from .calls.table_calls import TableCalls
from .calls.value_calls import ValueCalls
from .declare import Plan, Unary, declare

if TYPE_CHECKING:
    from ..shards.common import LiveResult


# declared_calls (and the site's client pages) lists a class's calls from its last base to its
# first: the bases stand here in the reverse of the order their calls are listed in.
class Calls(
    TableCalls,
    InfoCalls,
    GroupCalls,
    AdmissionCalls,
    LeaseCalls,
    PushCalls,
    ExperienceReads,
    ValueCalls,
    PromptCalls,
):
    """Every call the clients share, declared once (rpc/calls/, a module a kind)."""


class ListFilters(TypedDict, total=False):
    """The keywords of `list_experiences()` after the table: which experiences, and the page."""

    states: Iterable[str]
    min_model_version: int | None
    max_model_version: int | None
    after: int
    limit: int


class ServerCalls(Calls):
    """The calls of a client of one server: those it shares, and those of its own."""

    @declare()
    def writers(self, table: str = "default", change: int = 0, writer_id: str = "") -> Plan[tuple[int, bool]]:
        """Open (+1) or close (-1) a writer of the table, or read (0): (writers open, done),
        done once every writer that opened has closed (the table's end of data). A writer that
        names itself (`writer_id`, at most 64 bytes: `uuid.uuid4().hex`, the same at its open and
        its close) is counted once however often the call is made, so the client retries it, and
        its close counts only against the table it opened, not one dropped and made again under
        the name since. Without one, each call counts as made, and is not retried."""
        request = pb.WritersRequest(table=table, change=change, writer_id=writer_id)
        named = change != 0 and bool(writer_id)  # an open or a close: counted once by a server that remembers it
        return Unary("Writers", request, lambda r: (r.open, r.done), retry=change == 0 or named, remembered=named)

    @declare()
    def list_experiences(self, table: str = "default", **filters: Unpack[ListFilters]) -> Plan[ExperiencePage]:
        """A page of the table's live experiences in insertion order, optionally of some states and
        model versions; page on with `after=page.next` until `page.done`. Example:

        ```python
        page = client.list_experiences("grpo8", states=["ready"])
        experiences = client.get([e.uid for e in page.experiences], table="grpo8")
        ```
        """
        return _page(table, **filters)


class ShardCalls(Calls):
    """The calls of a sharded client: those it shares with a client of one server, and its own."""

    @declare(shards=lambda s: s._shard_stats)
    def shard_stats(self, table: str = "") -> Plan[LiveResult]:
        """Each answering shard's stats, by shard; `.missing` names the others."""
        raise NotImplementedError  # a sharded client's own: no server makes it (its stats are `stats`)


def _page(
    table: str,
    *,
    states: Iterable[str] = (),
    min_model_version: int | None = None,
    max_model_version: int | None = None,
    after: int = 0,
    limit: int = 1000,
) -> Unary[ExperiencePage]:
    """Of the table's live experiences in insertion order, those of `states` (all when empty) and of
    model versions in the range given, a page of up to `limit` after position `after`."""

    def optional(msg: Any, name: str) -> Any:
        return getattr(msg, name) if msg.HasField(name) else None

    def read(reply: pb.ListExperiencesReply) -> ExperiencePage:
        listed = [
            ListedExperience(
                e.uid, e.group_id, e.state, optional(e, "model_version"), optional(e, "reward"), e.times_sampled
            )
            for e in reply.experiences
        ]
        return ExperiencePage(listed, reply.next, reply.done)

    request = pb.ListExperiencesRequest(
        table=table,
        states=list(states),
        min_model_version=min_model_version,
        max_model_version=max_model_version,
        after=after,
        limit=limit,
    )
    return Unary("ListExperiences", request, read, retry=True)
