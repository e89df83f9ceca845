"""Log lines of an expbuf server: plain text by default, one JSON object per line on request.

One line per event that matters (start with its settings, tables created, groups
dropped, leases expired, refusals with their reason, shutdown). Payload bytes are
never logged.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class JsonFormatter(logging.Formatter):
    """{"ts", "level", "logger", "message"} and, for errors, "exception"."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler):
    """The handler `configure` installs, told apart from handlers the host process installed.

    It writes to sys.stderr as it is when a line comes (as logging's last resort does), not as it
    was when configured: a host that swaps sys.stderr (a test runner's capture, closed after its
    test) would otherwise see expbuf's threads fail to write to the closed one."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        """StreamHandler's constructor sets it; sys.stderr of the moment is used instead."""


def configure(log_format: str = "text", level: int = logging.INFO) -> None:
    """Route every expbuf logger to stderr in the given format (text | json).

    A second call replaces the first one's handler; handlers installed by the process that
    runs expbuf (a test runner, an embedding application) stay, so their capture keeps working.
    """
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
