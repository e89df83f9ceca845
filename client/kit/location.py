"""Where a Trinity-RFT experience buffer, or a taskset's prompts, live in expbuf:
`expbuf://HOST:PORT/TABLE?options`. verl's settings (expbuf.client.verl) name a buffer the same
way, so this lives beside the client, importable without Trinity-RFT.

The path carries the server, the table and how to reach it; secrets never do. A token is
read from an environment variable (EXPBUF_TOKEN, or the one named by `token_env`), because
Trinity-RFT logs its buffer configuration, path included.

Options (query) and their environment fallbacks:
    token_env=NAME        the variable holding the bearer token (default EXPBUF_TOKEN)
    tls=1                 TLS with the system's roots (EXPBUF_TLS=1); implied by the three below
    tls_ca=PATH           the server's CA (EXPBUF_TLS_CA)
    tls_cert=PATH         client certificate for mutual TLS (EXPBUF_TLS_CLIENT_CERT), with
    tls_key=PATH          its private key (EXPBUF_TLS_CLIENT_KEY)
    lease_seconds=S       the reader's lease (60): renewed while the reader lives, so a batch is
                          held as long as the trainer needs it; a killed reader's batch returns
                          within this long
    order=fifo            the reader's sampling order: fifo, lifo, uniform or priority
    delivery=lease        how the reader takes a batch: lease (acknowledged on the next read),
                          consume (gone once read) or replay (stays, counted against the
                          table's max_times_sampled)

A taskset's path names a dataset of prompts on the table (the prompt ledger) and where its
rows are, which Trinity's own file reader reads by index:
    dataset=NAME          the dataset (created beforehand: `expbuf dataset create`)
    source=PATH           the taskset's rows, as Trinity's file taskset path would name them
    lease_seconds=S       how long a claim lasts (60): renewed while the explorer lives, so a
                          killed explorer's prompts go out again within this long
    hold_seconds=S        how long a claim is renewed at most (21600): a task that never made a
                          group (every run failed) goes out again, with its next attempt

A table's settings (max_staleness, batch_size, on_stale, the rate limits, ...) are not
options: they belong to the table, fixed when it is created (TOML or create_table), and a
path naming one is refused with that said, rather than left to disagree with the table.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from expbuf.client.client import BufferClient, Tls
from expbuf.client.rpc.connection import DEFAULT_PORT, DEFAULT_TIMEOUT
from expbuf.client.rpc.wire import DELIVERY, OFF_POLICY_SETTINGS, ORDER

log = logging.getLogger(__name__)
SCHEME = "expbuf"
DEFAULT_TOKEN_ENV = "EXPBUF_TOKEN"
DEFAULT_LEASE_SECONDS = 60.0
# Trinity gives a task at most max_timeout x (max_retry_times + 1), 1800 s x 3 by default, and
# finalizes a step some steps after it read its tasks: a claim is kept four times that long.
DEFAULT_HOLD_SECONDS = 21600.0
OPTIONS = (
    "token_env", "tls", "tls_ca", "tls_cert", "tls_key", "lease_seconds", "order", "delivery",
    "dataset", "source", "hold_seconds",
)  # fmt: skip
_TABLE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def is_expbuf_path(path: object) -> bool:
    """True for a path this plugin serves (`expbuf://...`); every other path stays Trinity's."""
    return isinstance(path, str) and path.lower().startswith(SCHEME + "://")


@dataclass(frozen=True)
class Location:
    target: str
    table: str
    token: str | None = None
    tls: Tls | None = None
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    order: str = "fifo"
    delivery: str = "lease"
    dataset: str = ""  # a taskset's: the dataset of prompts, and where its rows are
    source: str = ""
    hold_seconds: float = DEFAULT_HOLD_SECONDS


def connect(location: Location, timeout: float = DEFAULT_TIMEOUT) -> BufferClient:
    """A client of the location's server, with its token and TLS."""
    return BufferClient(location.target, token=location.token, tls=location.tls, timeout=timeout)


def _flag(name: str, value: str) -> bool:
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"expbuf path option {name}={value[:40]!r} must be 1 or 0")


def _client_env(env: Mapping[str, str], var: str, old: str) -> str | None:
    """A client TLS variable, or (warned, for one more release) its old name, which the
    server also read for its own pair."""
    if var in env:
        return env[var]
    if old in env:
        log.warning("%s is renamed %s for clients (the old name is read until the next release)", old, var)
        return env[old]
    return None


def _tls(options: Mapping[str, str], env: Mapping[str, str]) -> Tls | None:
    ca = options.get("tls_ca", env.get("EXPBUF_TLS_CA")) or None
    cert = options.get("tls_cert", _client_env(env, "EXPBUF_TLS_CLIENT_CERT", "EXPBUF_TLS_CERT")) or None
    key = options.get("tls_key", _client_env(env, "EXPBUF_TLS_CLIENT_KEY", "EXPBUF_TLS_KEY")) or None
    if bool(cert) != bool(key):
        raise ValueError(
            "expbuf path: tls_cert and tls_key (EXPBUF_TLS_CLIENT_CERT, EXPBUF_TLS_CLIENT_KEY) go together"
        )
    wanted = _flag("tls", options.get("tls", env.get("EXPBUF_TLS", "")))
    if not (wanted or ca or cert):
        return None
    return Tls(root_certificates=ca, certificate_chain=cert, private_key=key)


def parse(path: str, env: Mapping[str, str] | None = None) -> Location:
    """Read an `expbuf://HOST:PORT/TABLE?...` path; a bad one is a ValueError naming the part."""
    env = os.environ if env is None else env
    if not is_expbuf_path(path):
        raise ValueError(f"path {path[:80]!r} is not an expbuf path (expbuf://HOST:PORT/TABLE)")
    parts = urlsplit(path)
    if "@" in parts.netloc:
        raise ValueError("expbuf path: credentials do not belong in the path; set EXPBUF_TOKEN or token_env=NAME")
    if not parts.hostname:
        raise ValueError(f"expbuf path {path[:80]!r} has no host (expbuf://HOST:PORT/TABLE)")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise ValueError(f"expbuf path {path[:80]!r} has an invalid port (1-65535)") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    table = parts.path.strip("/") or "default"
    if not _TABLE.match(table):
        raise ValueError(f"expbuf path: table {table[:80]!r} must be 1-64 letters, digits, '_', '.' or '-'")
    options: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name == "token":
            raise ValueError("expbuf path: a token never goes in the path; name its variable with token_env=NAME")
        if name in OFF_POLICY_SETTINGS:  # table settings: refused in a path, with where they go
            raise ValueError(
                f"expbuf path option {name} is a setting of the table, fixed when it is created: set it in the "
                "server's TOML [[tables]] or with create_table, not in the path"
            )
        if name not in OPTIONS:
            raise ValueError(f"expbuf path option {name[:40]!r} is unknown; expected one of {', '.join(OPTIONS)}")
        options[name] = value
    token_env = options.get("token_env", DEFAULT_TOKEN_ENV)
    token = env.get(token_env) or None
    if "token_env" in options and token is None:
        raise ValueError(f"expbuf path: token_env={token_env[:40]} but that environment variable is not set")
    lease_seconds = _seconds(options, "lease_seconds", DEFAULT_LEASE_SECONDS)
    hold_seconds = _seconds(options, "hold_seconds", DEFAULT_HOLD_SECONDS)
    order = options.get("order", "fifo")
    if order not in ORDER:
        raise ValueError(f"expbuf path option order={order[:40]!r}; expected one of {', '.join(ORDER)}")
    delivery = options.get("delivery", "lease")
    if delivery not in DELIVERY:
        raise ValueError(f"expbuf path option delivery={delivery[:40]!r}; expected one of {', '.join(DELIVERY)}")
    dataset, source = options.get("dataset", ""), options.get("source", "")
    if bool(dataset) != bool(source):
        raise ValueError(
            "expbuf path: dataset=NAME and source=PATH go together (a taskset's prompts, and where its rows are)"
        )
    tls = _tls(options, env)
    return Location(f"{host}:{port}", table, token, tls, lease_seconds, order, delivery, dataset, source, hold_seconds)


def _seconds(options: Mapping[str, str], name: str, default: float) -> float:
    try:
        seconds = float(options.get(name, default))
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"expbuf path option {name}={options[name][:40]!r} must be a number > 0")
    return seconds
