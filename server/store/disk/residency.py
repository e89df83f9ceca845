"""The server's resident memory while it reads a large data file through LMDB's map.

LMDB reads by mapping the whole data file: every page a read touches stays in the process's
resident set (RSS) until the kernel wants it back, so one pass over the file (the full check at
open, the scrub) makes RSS count the whole file, though those pages are only page cache, and a
container's memory limit counts them. `release` tells the kernel the process no longer needs the
map's pages (madvise MADV_DONTNEED): they leave the RSS and stay in the page cache, and the next
read of one maps it again from there (a minor fault, no disk read). LMDB's map is read-only (it
writes with write(2), not through the map), so no data is dropped, and a reader inside a page
released under it reads it again from the cache. Linux only; elsewhere `release` does nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Any

_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
_MAPS = Path("/proc/self/maps")


def _madvise() -> Any:
    """libc's madvise, or None where there is none to call."""
    if _MADV_DONTNEED is None or not _MAPS.exists():
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    call.restype = ctypes.c_int
    return call


_CALL = _madvise()


def mapped(path: Path) -> list[tuple[int, int]]:
    """The (start, end) addresses of this process's maps of the file at `path`, matched by
    device and inode (so a name that changed is still found)."""
    try:
        st = os.stat(path)
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or fields[4] != str(st.st_ino):
            continue
        major, _, minor = fields[3].partition(":")
        if (int(major, 16), int(minor, 16)) != (os.major(st.st_dev), os.minor(st.st_dev)):
            continue
        start, _, end = fields[0].partition("-")
        ranges.append((int(start, 16), int(end, 16)))
    return ranges


def release(path: Path) -> int:
    """Give back the resident pages of this process's maps of `path`; the bytes of map advised
    (0 where the platform has no madvise)."""
    if _CALL is None or _MADV_DONTNEED is None:
        return 0
    advised = 0
    for start, end in mapped(path):
        if _CALL(start, end - start, _MADV_DONTNEED) == 0:
            advised += end - start
    return advised
