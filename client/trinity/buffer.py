"""Trinity-RFT's BufferWriter and BufferReader over an expbuf table.

The explorer's experience pipeline writes through ExpbufWriter; the trainer's sample
strategy reads through ExpbufReader. Both take the StorageConfig Trinity-RFT builds from
its `buffer.trainer_input.experience_buffer` section, whose `path` is `expbuf://HOST:PORT/TABLE`.
Experiences of a task read from an expbuf dataset (taskset.py) are written under their prompt's
EID, so that they make the prompt's group.
Trinity's interface is asyncio; the blocking client runs in a worker thread, so either works
from whichever event loop Trinity calls it on.

The writer is writer.py's, the reader reader.py's; this module is the path Trinity-RFT's configs
and earlier releases name.
"""

from __future__ import annotations

from .reader import ExpbufReader
from .writer import ExpbufWriter

__all__ = ["ExpbufReader", "ExpbufWriter"]
