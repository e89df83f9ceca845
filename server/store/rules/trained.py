"""Groups a trainer trained without a lease of this table (a framework's own queue holds them),
retired by their ids as an ack retires a lease's (the records' part is core/verbs/retire.consume).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.table_state.state import TableState
from ..core.verbs import leases
from ..core.verbs.retire import consume
from ..core.verbs.rows import moves as row_moves
from ..schema.errors import Forbidden, GroupIncomplete, clip, taken_with
from ..schema.states import LEASED, READY, RETIRED
from ..schema.views import GroupView


def retire_trained(tt: TableState, group_ids: Sequence[str], owner: str = "") -> int:
    """Groups a trainer trained without a lease of this table (a framework's own queue holds
    them): consumed, as an ack consumes a lease's, so their payloads go, their tombstones stay
    (a push of them again is a duplicate) and a prompt whose group it is is trained. Ready
    groups, and groups leased with the caller's token, retire; an absent or retired one is left
    alone (a retried call changes nothing); an incomplete one is refused, and then none retires.
    Returns the groups retired."""
    found: dict[str, GroupView] = {}
    for gkey in group_ids:
        grp = tt.view(gkey)
        if grp is None or grp.state in RETIRED or gkey in found:
            continue
        if grp.state not in (READY, LEASED):
            raise GroupIncomplete(
                f"group {clip(gkey)} is {grp.state}: only a complete group (ready or leased) retires as trained"
            )
        if grp.under_lease:
            held = leases.owner_of(tt, grp.lease)
            if held is not None and held != owner:
                raise Forbidden(f"group {clip(gkey)} is leased with {taken_with(held, owner)}")
        found[gkey] = grp
    groups = list(found.items())
    if tt.config.storage.layout == "rows":
        row_moves.consume(tt, list(found))
    else:
        consume(tt, groups)
    return len(groups)
