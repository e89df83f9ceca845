"""The bytes a process hands to the kernel's write calls (/proc/PID/io's `wchar`): LMDB's page writes,
for a benchmark that runs a store in its own process, or for a server's process (gRPC sends with
sendmsg, which `wchar` does not count; what it counts besides the commits is the server's log lines).

Not `write_bytes`: on a kernel whose page cache keeps a file in large folios (Linux 6.x on ext4), a
page written into a folio counts the whole folio, so the scattered pages of a commit that touches
many B-tree leaves (a push reaching hundreds of groups, keys in no order) count several times what
is written. Measured: a rows table's groups of 8 pushed spread over 8 pushes, `write_bytes` 23,076
bytes an experience against 13,647 handed to pwrite/writev (strace's sum of them agrees with `wchar`
to the byte); pushed whole, 13,698 against 12,680.
"""

from __future__ import annotations


def written(pid: int | str = "self") -> int:
    """Bytes process `pid` (this one by default) has handed to write calls: its commits' pages."""
    with open(f"/proc/{pid}/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar:"))
