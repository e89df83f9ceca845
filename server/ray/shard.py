"""One expbuf shard as a Ray actor: a plain expbuf server whose data lives under `data_root/shard`
on its node, which it keeps for one buffer (its namespace and name), and which a restart by Ray
waits for (its previous process going away) before it serves again, on its saved port or, where
that stays taken, on a fresh one that it publishes in the buffer's shard map."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from .registry import publish

if TYPE_CHECKING:
    from expbuf.server.app import ExpbufServer
    from expbuf.server.config import ServerConfig

log = logging.getLogger("expbuf")

_PORT_FILE = "ray-port"
# The buffer a shard's data directory belongs to: {"namespace": ..., "name": ...}.
OWNER_FILE = "ray-buffer"
# The file of a data directory that its server (and a reader such as `expbuf check`) holds a flock on
# (server/store/disk/environment/directory.py).
_LOCKED_FILE = "data.mdb"
# How long a restarted shard waits for a process still holding its data directory: its crashed
# predecessor going away, an `expbuf check` reading it. A shard's first start does not wait.
_LOCK_WAIT_SECONDS = 120.0
# How long a shard waits for its saved port, taken by another socket, before it serves on a fresh one.
_PORT_WAIT_SECONDS = 5.0


def owner_record(namespace: str, name: str) -> str:
    """The record of a buffer in the data it owns: a buffer is its name in its Ray namespace."""
    return json.dumps({"namespace": namespace, "name": name})


class ShardActor:
    """One expbuf server inside a Ray actor, its data under `data_root/shard` on this node."""

    def __init__(
        self, shard: str, namespace: str, name: str, data_root: str, tables: Sequence[dict[str, Any]], metrics_port: int
    ) -> None:
        from expbuf.server import logs
        from expbuf.server.app import StartupError
        from expbuf.server.config import ServerConfig
        from expbuf.server.store.schema.table_config import TableConfig

        logs.configure()  # its INFO lines (listening, stopped, upkeep) in the actor's log, as `expbuf serve`'s
        data = Path(data_root) / shard
        data.mkdir(parents=True, exist_ok=True)
        owner = owner_record(namespace, name)
        refusal = owner_refusal(data / OWNER_FILE, owner)
        if refusal:
            raise StartupError(f"shard {shard}: data directory {refusal}")
        port_file = data / _PORT_FILE
        saved = int(port_file.read_text()) if port_file.exists() else 0
        config = ServerConfig(
            data=str(data),
            host=ray.util.get_node_ip_address(),
            port=saved,
            metrics_port=metrics_port,
            shard=shard,
            tables=tuple(TableConfig.from_settings(t) for t in tables),
        )
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.server = _serve(config, restarted)
        (data / OWNER_FILE).write_text(owner)  # once it holds the directory, not before
        port_file.write_text(str(self.server.port))
        self.address = f"{config.host}:{self.server.port}"
        self.metrics_address = f"{config.host}:{self.server.metrics_port}" if self.server.metrics_port else ""
        if restarted and self.server.port != saved:
            publish(namespace, name, shard, self.address)
        threading.Thread(target=self._watch, name="expbuf-shard-watch", daemon=True).start()

    def _watch(self) -> None:
        """End the process where the store can take no more writes (its disk failed a write, a map
        it could not grow), as `expbuf serve` exits 3 for its supervisor: Ray restarts the shard on
        its data (max_restarts). Left, it refused every push UNAVAILABLE for good."""
        while self.server.broken is None:
            time.sleep(0.5)
        log.error("shard stopping: the store can take no more writes (%s); Ray starts it again", self.server.broken)
        self.server.stop()
        os._exit(3)

    def target(self) -> str:
        return self.address

    def metrics_target(self) -> str:
        """Where its Prometheus metrics are served (host:port; empty with metrics_port -1): a port of
        its own, picked at each start with the default metrics_port 0."""
        return self.metrics_address

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.server.stop()


def owner_refusal(owner_file: Path, owner: str) -> str | None:
    """Why a data directory (or data root) that another buffer made is refused to `owner` (its namespace
    and name), which would otherwise serve, and sample, experiences another job pushed; None when it is ours."""
    return refusal_by(owner_file.read_text(), owner, str(owner_file.parent)) if owner_file.exists() else None


def refusal_by(theirs: str, owner: str, where: str) -> str | None:
    """owner_refusal of the owner record `theirs` ("" for none) that `where` keeps."""
    if not theirs or theirs == owner:
        return None
    held, ours = json.loads(theirs), json.loads(owner)
    return (
        f"{where} belongs to the buffer {held['name']!r} of Ray namespace {held['namespace']!r},"
        f" not to {ours['name']!r} of {ours['namespace']!r}: give this buffer a data_root of its own"
    )


def _serve(config: ServerConfig, restarted: bool) -> ExpbufServer:
    """The shard's server, started once what keeps it from starting has gone: a restart waits for the
    data directory (Ray gives up for good on an actor whose constructor raised), and a port taken for
    longer than _PORT_WAIT_SECONDS is given up for a fresh one. Other failures raise at once."""
    from expbuf.server.app import ExpbufServer, StartupError

    data = Path(config.data)
    started = time.monotonic()
    while True:
        try:
            return ExpbufServer(config).start()
        except StartupError:
            waited = time.monotonic() - started
            if _in_use(data):
                if not restarted:
                    raise StartupError(
                        f"shard {config.shard}: data directory {data} is in use by another process (another"
                        " buffer's shard, an `expbuf serve` or an `expbuf check`): give each buffer a data_root"
                        " of its own"
                    ) from None
                if waited >= _LOCK_WAIT_SECONDS:
                    raise StartupError(
                        f"shard {config.shard}: data directory {data} still in use by another process after"
                        f" {_LOCK_WAIT_SECONDS:.0f} s (the shard's previous process, or an `expbuf check`), and Ray"
                        " does not restart it again: end that process, then expbuf.ray.stop_shards and start_shards"
                    ) from None
            elif config.port and _port_taken(config.host, config.port):
                if waited >= _PORT_WAIT_SECONDS:
                    log.warning(
                        "shard %s: port %d still taken after %.0f s: serving on a fresh port, published in the shard"
                        " map (clients take it with client.set_map(expbuf.ray.shard_map(namespace)))",
                        config.shard,
                        config.port,
                        _PORT_WAIT_SECONDS,
                    )
                    config = replace(config, port=0)
                    continue
            else:
                raise
        time.sleep(0.2)


def _in_use(data: Path) -> bool:
    """Whether another process holds the data directory's lock, a server's or a reader's."""
    try:
        fd = os.open(data / _LOCKED_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _port_taken(host: str, port: int) -> bool:
    """Whether another socket holds the port (bound as the server binds it: TIME_WAIT is no conflict)."""
    family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError:
            return True
    return False
