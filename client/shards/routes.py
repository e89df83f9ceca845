"""Every plan of the sharded clients in one class: what a declared call's route names
(rpc/declare.py: `shards=lambda s: s._fail_runs`), and what the two drivers (blocking.py, aio.py)
inherit."""

from __future__ import annotations

from .ledger import LedgerPlans
from .reads import ReadPlans
from .sampling import SamplePlans
from .values import ValuePlans


class ShardPlans(LedgerPlans, ReadPlans, SamplePlans, ValuePlans):
    """The plans of every call over shards: the tables, pushes, leases and admin (plans.py), the
    sample (sampling.py), the reads (reads.py), the keyed values (values.py) and the prompt ledger
    (ledger.py)."""
