"""What the clients return, a module a kind of call: what a write stored (writes.py: pushes,
failed runs), batches (batches.py: sampled, and fields read as columns), the rollouts a worker
may start (admission.py), the reads of named experiences (reads.py), stats (stats.py), the
server's info (server_info.py) and a table's settings (tables.py). Every name imports from here.

Plain data, built from the service's replies by the clients (client.py); a sampled batch
decodes its payload on first use and acknowledges through the client that made it.

May import the codec (trxp/) and the shapes below it (schema/); its modules know nothing of
each other (the import contracts).
"""

from .admission import Grant
from .batches import AsyncBatch, Batch, Columnar, FieldBatch, Leases
from .reads import ExperiencePage, GetResult, ListedExperience
from .server_info import ScrubInfo, ServerInfo
from .stats import BufferStats, TableStats
from .tables import ShapingInfo, TableInfo
from .writes import FailedRuns, PushResult

__all__ = [
    "AsyncBatch",
    "Batch",
    "BufferStats",
    "Columnar",
    "ExperiencePage",
    "FailedRuns",
    "FieldBatch",
    "GetResult",
    "Grant",
    "Leases",
    "ListedExperience",
    "PushResult",
    "ScrubInfo",
    "ServerInfo",
    "ShapingInfo",
    "TableInfo",
    "TableStats",
]
