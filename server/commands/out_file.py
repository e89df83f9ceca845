"""Where an export writes (`--out FILE` of `expbuf export` and `expbuf dataset export`): whole or
not at all, in the file's place, with the file's mode."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Any


def export_file(out: str | None, *, binary: bool) -> Written | None:
    """Where `--out` says to write (None: standard output); an empty name is OSError, as a
    file that cannot be made is (it wrote to standard output)."""
    if out is None:
        return None
    if not out:
        raise OSError(errno.ENOENT, "no file named (leave --out out for standard output)")
    return Written(Path(out), binary=binary)


class Written(contextlib.AbstractContextManager[Any]):
    """The file `path` names, written whole or not at all: a regular file (or a new one) is written
    beside it under a hidden name and takes its place once `whole` is set and it closes, with the
    mode the file had (a new one's as the umask makes it); otherwise it goes, and what the file held
    stays. Through a symbolic link, the file it names takes the export, the link stays. A pipe or a
    device (/dev/stdout) is written in place: it keeps nothing to replace. A directory is
    IsADirectoryError, as open() raises it."""

    def __init__(self, path: Path, *, binary: bool) -> None:
        try:
            kind = os.stat(path).st_mode
        except FileNotFoundError:
            kind = None
        if kind is not None and stat.S_ISDIR(kind):
            raise IsADirectoryError(errno.EISDIR, "Is a directory")
        self.whole, self.partial, self.path = False, None, path
        if kind is not None and not stat.S_ISREG(kind):
            self.file: Any = path.open("wb") if binary else path.open("w", encoding="utf-8")
            return
        self.path = Path(os.path.realpath(path))  # through links: the file itself is replaced
        handle, name = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".partial")
        self.partial = Path(name)
        os.fchmod(handle, stat.S_IMODE(kind) if kind is not None else 0o666 & ~_umask())
        self.file = os.fdopen(handle, "wb") if binary else os.fdopen(handle, "w", encoding="utf-8")

    def __enter__(self) -> Any:
        return self.file

    def __exit__(self, *exc: object) -> None:
        self.file.close()
        if self.partial is None:
            return
        if self.whole:
            os.replace(self.partial, self.path)
        else:
            self.partial.unlink(missing_ok=True)


def _umask() -> int:
    """The process's umask, which reading sets: set back at once."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
