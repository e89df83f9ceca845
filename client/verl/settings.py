"""`trainer.v1.sampler.sampler_kwargs.expbuf`: where the buffer is, which table, which mode, and
how verl's own settings must agree with the table's.

    expbuf:
      target: 127.0.0.1:50051   # the server (host:port)
      table: verl_grpo          # the table (mirror mode: group_by = "task", group_size = 0)
      mode: mirror              # mirror (default) or source
      token_env: EXPBUF_TOKEN   # the variable holding the bearer token (never the token itself)
      tls: false                # TLS with the system's roots; tls_ca, tls_cert, tls_key as files
      lease_seconds: 60         # source mode: how soon a dead trainer's leased groups go back
                                # (renewed every third of it while the trainer lives)
      wait_seconds: 30          # source mode: how long one request waits for enough fresh groups
      restore: true             # mirror mode: put pushed, untrained groups back after a restart

Token and TLS work as in the Trinity-RFT plug-in (expbuf.client.kit.location), and the
same environment fallbacks apply (EXPBUF_TOKEN, EXPBUF_TLS, EXPBUF_TLS_CA, ...).

verl counts off-policy spans in steps, `max_off_policy_threshold = s + 1` meaning a trajectory
may span s + 1 policy versions; the table's `max_staleness = s` lets a group lag the trainer's
version by s. `algorithm.filter_groups` (DAPO) is the table's `drop_zero_variance`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from expbuf.client.kit.location import Location, parse

logger = logging.getLogger(__name__)

MODES = ("mirror", "source")
LEASE_SECONDS = 60.0  # a trainer that dies holds its step's groups this long; a live one renews
_LOCATION_OPTIONS = ("token_env", "tls", "tls_ca", "tls_cert", "tls_key", "lease_seconds")
KNOWN = ("target", "table", "mode", "wait_seconds", "restore", *_LOCATION_OPTIONS)


@dataclass(frozen=True)
class Settings:
    location: Location
    mode: str = "mirror"
    wait_seconds: float = 30.0
    restore: bool = True


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def read(sampler_kwargs: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> Settings:
    """Settings from verl's `sampler_kwargs`; a missing or unknown key is a ValueError naming it."""
    raw = dict((sampler_kwargs or {}).get("expbuf") or {})
    if not raw:
        raise ValueError("trainer.v1.sampler.sampler_kwargs.expbuf is missing: set at least its target and table")
    unknown = sorted(set(raw) - set(KNOWN))
    if unknown:
        raise ValueError(f"sampler_kwargs.expbuf.{unknown[0]} is unknown; expected some of {', '.join(KNOWN)}")
    for name in ("target", "table"):
        if not raw.get(name):
            raise ValueError(f"sampler_kwargs.expbuf.{name} is required")
    mode = str(raw.get("mode", "mirror"))
    if mode not in MODES:
        raise ValueError(f"sampler_kwargs.expbuf.mode={mode!r}; expected one of {', '.join(MODES)}")
    target = str(raw["target"]).removeprefix("expbuf://").rstrip("/")
    if "/" in target or "?" in target:
        raise ValueError(f"sampler_kwargs.expbuf.target={target[:80]!r} must be HOST:PORT")
    options = {"lease_seconds": LEASE_SECONDS} | {k: raw[k] for k in _LOCATION_OPTIONS if k in raw}
    query = urlencode({k: _text(v) for k, v in options.items()})
    location = parse(f"expbuf://{target}/{raw['table']}?{query}", env or os.environ)
    try:
        wait_seconds = float(raw.get("wait_seconds", 30.0))
    except (TypeError, ValueError):
        wait_seconds = -1.0
    if not 0 < wait_seconds < float("inf"):
        raise ValueError(f"sampler_kwargs.expbuf.wait_seconds={raw['wait_seconds']!r} must be a number > 0")
    restore = raw.get("restore", True)
    if not isinstance(restore, bool):
        raise ValueError(f"sampler_kwargs.expbuf.restore={restore!r} must be true or false")
    return Settings(location, mode, wait_seconds, restore)


def staleness_disagreement(max_off_policy_threshold: int | None, max_staleness: int | None) -> str | None:
    """Why verl's off-policy threshold and the table's max_staleness disagree (None when they agree)."""
    if max_staleness is None:
        if max_off_policy_threshold is None:
            return None
        want = f"the table's max_staleness = {max_off_policy_threshold - 1} (it has none)"
    elif max_off_policy_threshold is None:
        want = f"max_off_policy_threshold = {max_staleness + 1} (verl has none)"
    elif max_off_policy_threshold == max_staleness + 1:
        return None
    else:
        want = f"max_off_policy_threshold = {max_staleness + 1} for the table's max_staleness = {max_staleness}"
    return (
        f"verl's trainer.v1.sampler.max_off_policy_threshold={max_off_policy_threshold} and the expbuf table's "
        f"max_staleness={max_staleness} disagree: verl's threshold s + 1 is the table's s; set {want}"
    )


def filter_disagreement(filter_groups: bool, drop_zero_variance: bool) -> str | None:
    """Why algorithm.filter_groups and the table's drop_zero_variance disagree (None when they agree)."""
    if bool(filter_groups) == bool(drop_zero_variance):
        return None
    return (
        f"verl's algorithm.filter_groups.enable={bool(filter_groups)} and the expbuf table's "
        f"drop_zero_variance={bool(drop_zero_variance)} disagree: both drop groups whose rewards are all equal"
    )
