"""Look at the built docs site in a real headless browser (`make docs-look`): serve build/site on
a free port of the loopback, and have Debian's chromium draw each page given (its path under the
site, "" for the home page) into a PNG under build/docs-look, so a person sees whether the
diagrams draw. The browser runs with no network beyond the loopback, as a reader offline would.

usage: python docs/look.py [PAGE ...]
"""

from __future__ import annotations

import functools
import http.server
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "build" / "site"
SHOTS = ROOT / "build" / "docs-look"
PAGES = ("", "concepts/prompt-ledger/", "internals/layout/")
# Chromium's own calls home are refused on a closed network, many at a time: turned off.
QUIET = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")  # fmt: skip


class Quiet(http.server.SimpleHTTPRequestHandler):
    """Serves the site without a log line per file."""

    def log_message(self, format: str, *args: object) -> None:
        pass


def main(pages: list[str]) -> int:
    browser = shutil.which("chromium")
    if browser is None:
        print("make docs-look needs a browser: Debian's package chromium (/usr/bin/chromium)", file=sys.stderr)
        return 1
    if not (SITE / "index.html").is_file():
        print(f"no site in {SITE}: build it first (make docs-look does)", file=sys.stderr)
        return 1
    handler = functools.partial(Quiet, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    SHOTS.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory() as profile:
            for page in pages or PAGES:
                shot = SHOTS / f"{page.strip('/').replace('/', '-') or 'home'}.png"
                url = f"http://127.0.0.1:{server.server_address[1]}/{page}"
                command = [browser, *QUIET, f"--user-data-dir={profile}", "--window-size=1280,1400",
                           "--virtual-time-budget=8000", f"--screenshot={shot}", url]  # fmt: skip
                done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
                if done.returncode != 0 or not shot.is_file():
                    print(f"chromium could not draw {url}: {done.stderr[-500:]}", file=sys.stderr)
                    return 1
                print(f"{url} -> {shot.relative_to(ROOT)}")
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
