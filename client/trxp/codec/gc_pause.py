"""The garbage collector held off while a batch is decoded.

Decoding a batch makes a dozen tracked objects an item (its metadata's dicts and lists, its
tensors' views and records) that live until the batch's experiences are made, then go. Made
hundreds at once, they outnumber the collector's first threshold, so its passes run mid-decode,
find them alive and move them to older generations; enough of those make a full collection, which
walks every object of the caller's process (torch's among them, hundreds of thousands). On a
trainer's consume stream of 8 KB experiences the collector took about a third of the client's CPU.
With the collector held off, those objects are freed by their reference counts before any pass
sees them; the passes due meanwhile run at the next allocation after, on what is left.

Process-wide, as the collector is: nested and concurrent decodes hold it off together, and the
last to end lets it run again, only where it was running when the first began. A `gc.disable()`
made by another thread while a decode runs is undone when the decode ends. A process forked while
a decode runs on another thread (a DataLoader's workers, say) has no such decode: its collector
runs there as it ran before the decode began.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_holding = 0  # decodes under way
_resume = False  # whether the collector ran when the first of them began


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Hold the garbage collector's automatic passes off for the block (decoding makes no cycles)."""
    global _holding, _resume
    with _lock:
        if not _holding:
            _resume = gc.isenabled()
            gc.disable()
        _holding += 1
    try:
        yield
    finally:
        with _lock:
            _holding -= 1
            if not _holding and _resume:
                gc.enable()


def _forked() -> None:
    """In a child forked while decodes ran: none runs here (their threads were not copied), so the
    collector runs again if it ran before them, and the lock, which one of them may have held, is new."""
    global _lock, _holding
    _lock = threading.Lock()
    if _holding:
        _holding = 0
        if _resume:
            gc.enable()


os.register_at_fork(after_in_child=_forked)
