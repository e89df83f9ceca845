"""The storage engine is fenced: the import contract that it reaches neither grpc, protobuf nor torch
(pyproject.toml) breaks on a probe import that breaks it, and holds on the tree as it is.

lint-imports reads a copy of the packages laid out under their installed names (expbuf/server,
expbuf/client, expbuf/proto, expbuf/ray) in a temporary directory: run there, it puts that
directory first on sys.path, ahead of the editable install. That it reads the copy shows in the
probes: each exists only in the copy, and the report names the probed module."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TREES = {"server": "server", "client": "client", "proto": "proto/expbuf", "ray": "server/ray"}
FENCE = "The storage engine imports neither grpc, protobuf nor torch"
# A store module, what is added to it, and the forbidden package it then reaches.
PROBES = [
    ("schema.states", "\n\ndef _probe() -> None:\n    import torch  # noqa: F401\n", "torch"),
    ("engine", "\nimport grpc  # noqa: E402\n", "grpc"),
    ("disk.records", "\nfrom expbuf.client import trxp  # noqa: E402  (its convert.py imports torch)\n", "torch"),
    ("schema.estimator_registry", "\nfrom expbuf.client.rpc import wire  # noqa: E402\n", "google"),
]
# A module (its path in the installed package, under expbuf/), the module it is made to import,
# and the contract that import breaks: one for each contract over the rooms and inside them.
ROOM_PROBES = [
    ("server/store/schema/errors.py", "..services.sampling", "The storage engine imports only downward"),
    ("server/store/services/index_builds.py", ".sampling", "The store's services import only downward"),
    ("server/store/tables/taking.py", ".catalog", "The store's tables import only downward"),
    ("server/store/ledger/records.py", ".rules", "The prompt ledger imports only downward"),
    ("server/store/ledger/claim_life.py", ".outcomes", "The prompt ledger imports only downward"),  # its rules
    ("server/store/rules/extensions.py", ".groups", "The store's rules import only downward"),
    ("server/store/core/ordering/indexes.py", "..table_state.counters", "The table core imports only downward"),
    ("server/store/core/whole_table/verify.py", ".reading", "The table core's whole-table work is independent"),
    ("server/store/core/verbs/pieces.py", ".retire", "The table core's verbs import only downward"),
    ("server/store/core/verbs/rows/pending.py", ".ends", "A rows table's verbs import only downward"),
    ("server/store/core/table_state/counters.py", ".state", "The table state imports only downward"),
    ("server/store/core/ordering/indexes.py", ".orders", "The orders of ready groups import only downward"),
    ("server/store/schema/errors.py", ".states", "The store's schema imports only downward"),
    ("server/store/disk/rows/members.py", ".runs", "The rows import only downward"),
    ("server/store/disk/environment/readers.py", ".writer", "The LMDB environment imports only downward"),
    ("server/store/rules/groups.py", "..disk.rows", "Only the table core reads and writes the rows"),
    ("server/config.py", ".app", "The server imports only downward, the storage engine at the bottom"),
    ("server/rpc/interceptors/base.py", "...service", "The gRPC service imports only downward"),
    ("server/rpc/push/ingest.py", "..sample.replies", "The gRPC service imports only downward"),  # push | sample
    ("server/rpc/servicers/values.py", ".reads", "The servicers are independent"),
    ("server/rpc/push/inflight.py", ".push_stream", "A push's path imports only downward"),
    ("server/rpc/sample/replies.py", ".sample_stream", "A Sample stream's parts are independent"),
    ("server/rpc/interceptors/base.py", ".auth", "The interceptors import only downward"),
    ("server/advantages/moments.py", ".worker", "The advantages import only downward"),
    ("server/commands/tables.py", ".stats", "The command line's tools import only downward"),
    ("server/commands/stats.py", "..store.ledger.records", "Code above the store reaches it through its face"),
    ("server/rpc/sample/replies.py", "...store.disk.layout", "Code above the store reaches it through its face"),
    ("client/schema/routing.py", "..rpc.wire", "The client imports only downward"),
    ("client/rpc/calls/push_calls.py", "...shards.plans", "The client imports only downward"),
    ("client/pushers/blocking.py", "..client.BufferClient", "The client imports only downward"),
    ("client/kit/tables.py", "..trinity.settings", "The client imports only downward"),
    ("client/results/stats.py", ".tables", "What the clients return is independent, a module a kind of call"),
    ("client/trl/worker.py", "..areal.workflow", "The client imports only downward"),  # adapters: independent
    ("client/trxp/codec/common.py", "..stored.pieces", "The codec's rooms import only downward"),
    ("client/trxp/stored/pieces.py", "google.protobuf.message", "The codec's rooms the store reads import no protobuf"),
    ("client/trxp/varints.py", "expbuf.proto.v1.buffer_pb2", "The codec's rooms the store reads import no protobuf"),
    ("client/trxp/codec/common.py", ".checks", "The TRXP codec imports only downward"),
]
# The most modules a room (a folder of them, its __init__ aside) holds (#65).
MAX_MODULES = 15


def importlinter_settings() -> str:
    """The [tool.importlinter] tables of pyproject.toml, as they are written there."""
    lines, inside = [], False
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith("["):
            inside = line.strip("[]").startswith("tool.importlinter")
        if inside:
            lines.append(line)
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("fence")
    for name, source in TREES.items():
        skip = shutil.ignore_patterns("__pycache__", "_native", "*.so")
        shutil.copytree(ROOT / source, root / "expbuf" / name, ignore=skip)
    (root / "importlinter.toml").write_text(importlinter_settings())
    yield root


def lint(root: Path) -> tuple[int, str]:
    command = [str(Path(sys.executable).parent / "lint-imports"), "--config", "importlinter.toml", "--no-cache"]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120, check=False)
    return done.returncode, done.stdout + done.stderr


def printed(child: str) -> list[str]:
    """The lines a fresh interpreter running `child` prints (it must succeed)."""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_importing_every_module_of_the_store_loads_neither_grpc_protobuf_nor_torch() -> None:
    """What the contract says statically, seen in a process: a tool that opens a data directory
    (the store alone) pays for none of the wire's or the estimators' libraries."""
    child = (
        "import importlib, pkgutil, sys\n"
        "import expbuf.server.store as store\n"
        "for found in pkgutil.walk_packages(store.__path__, 'expbuf.server.store.'):\n"
        "    importlib.import_module(found.name)\n"
        "heavy = ('grpc', 'google.protobuf', 'expbuf.proto', 'torch')\n"
        "print(sorted(name for name in sys.modules if name.startswith(heavy)))\n"
        "print(sum(name.startswith('expbuf.server.store.') for name in sys.modules))\n"
    )
    loaded, modules = printed(child)
    assert loaded == "[]"
    assert int(modules) > 40  # every module of the store was imported


def test_the_command_line_loads_the_store_only_for_the_commands_that_open_it() -> None:
    """`expbuf stats`, `table`, `dataset`, `health`: a client's commands read the store's schema
    (settings, refusals) and nothing else of it; its façade imports each name at its first use, so
    neither the engine nor LMDB loads for them (they start in about half the time)."""
    child = (
        "import sys\n"
        "import expbuf.server.cli\n"
        "print(sorted({name.split('.')[3] for name in sys.modules if name.startswith('expbuf.server.store.')}))\n"
        "print('lmdb' in sys.modules)\n"
        "from expbuf.server.store import Store, scan_directory\n"
        "print(Store.__module__, scan_directory.__name__)\n"
        "import expbuf.server.store as store\n"
        "print(store.disk.layout.FORMAT == store.FORMAT, store.schema.states.READY == store.READY)\n"
        "print(hasattr(store, 'nothing_of_the_store'))\n"
    )
    rooms, lmdb, loaded, rooms_reached, unknown = printed(child)
    assert rooms == "['schema']" and lmdb == "False", (rooms, lmdb)
    assert loaded == "expbuf.server.store.engine scan", loaded
    assert rooms_reached == "True True" and unknown == "False", (rooms_reached, unknown)  # as when it loaded all


def test_an_ingest_process_loads_the_decoding_and_nothing_of_the_service() -> None:
    """A server starts its ingest processes as fresh interpreters running ingest_worker.py (at every
    start, and again for each that dies): each loads the codec and the store's entry, not the
    service, the command line, gRPC or torch, which cost a start about twice the CPU."""
    child = (
        "import runpy, sys\n"
        "sys.argv = ['ingest_worker']\n"  # run as the server runs it, short of its file descriptors
        "runpy.run_module('expbuf.server.rpc.push.ingest_worker', run_name='not_main', alter_sys=True)\n"
        "heavy = ('expbuf.server.rpc.service', 'expbuf.server.rpc.push.ingest', 'expbuf.server.cli', "
        "'expbuf.server.app', 'expbuf.server.config', 'expbuf.server.store.engine', 'grpc', 'torch')\n"
        "print([name for name in heavy if name in sys.modules])\n"
    )
    (loaded,) = printed(child)
    assert loaded == "[]", loaded


def test_the_tree_as_it_is_keeps_every_contract(tree: Path) -> None:
    status, out = lint(tree)
    assert status == 0 and f"{FENCE} KEPT" in out and ", 0 broken." in out, out


@pytest.mark.parametrize(("module", "probe", "reached"), PROBES)
def test_a_probe_import_breaks_the_fence(tree: Path, module: str, probe: str, reached: str) -> None:
    path = tree / "expbuf" / "server" / "store" / f"{module.replace('.', '/')}.py"
    source = path.read_text()
    path.write_text(source + probe)
    try:
        status, out = lint(tree)
    finally:
        path.write_text(source)
    assert status == 1 and f"{FENCE} BROKEN" in out and ", 1 broken." in out, out
    assert f"expbuf.server.store is not allowed to import {reached}:" in out, out
    assert f"expbuf.server.store.{module} -> " in out, out


@pytest.mark.parametrize(("where", "imported", "contract"), ROOM_PROBES)
def test_a_probe_import_breaks_each_contract_over_the_rooms(
    tree: Path, where: str, imported: str, contract: str
) -> None:
    path = tree / "expbuf" / where
    source = path.read_text()
    parent, name = imported.rsplit(".", 1)
    path.write_text(f"{source}\n\ndef _probe() -> None:\n    from {parent or '.'} import {name}  # noqa: F401\n")
    try:
        status, out = lint(tree)
    finally:
        path.write_text(source)
    # (an import up across rooms closes cycles that break the rooms' own orders too)
    assert status == 1 and f"{contract} BROKEN" in out, out


def modules_per_room() -> dict[str, int]:
    """Each folder of server/ and client/ that holds modules (themselves included), and how many."""
    folders = [ROOT / "server", ROOT / "client"]
    folders += [path for top in folders for path in top.rglob("*") if path.is_dir()]
    counts = {
        str(folder.relative_to(ROOT)): sum(path.name != "__init__.py" for path in folder.glob("*.py"))
        for folder in folders
        if "__pycache__" not in folder.parts and "_native" not in folder.parts
    }
    return {folder: count for folder, count in counts.items() if count}


def test_no_room_holds_more_than_15_modules() -> None:
    counts = modules_per_room()
    assert counts["client"] > 0 and counts["client/trxp/codec"] > 0  # the walk reached the rooms
    crowded = {folder: count for folder, count in counts.items() if count > MAX_MODULES}
    assert crowded == {}


def test_the_layout_page_has_a_row_for_each_room_and_names_only_what_exists() -> None:
    """docs/internals/layout.md's table of rooms: each room of server/ and client/ (a folder that is
    a package) is named in it, and each path a row names is in the tree, so the page moves with
    the rooms."""
    page = (ROOT / "docs" / "internals" / "layout.md").read_text()
    table = page[page.index("## Rooms, top to bottom") :].split("\n\n")[2]
    named = [path for line in table.splitlines()[2:] for path in re.findall(r"`([^`]+)`", line.split(" | ")[0])]
    rooms = {
        str(init.parent.relative_to(ROOT)) + "/"
        for top in ("server", "client")
        for init in (ROOT / top).rglob("__init__.py")
        if "_native" not in init.parts and init.parent.name not in ("server", "client")
    }
    assert len(named) > 40 and rooms - set(named) == set()
    assert [path for path in named if not (ROOT / path).exists()] == []
