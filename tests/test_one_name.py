"""One name, one thing: a class or a `check_*` function is defined in one module of the server
and the client, so that a reader (and an import) never meets two types or two checks of one
name. The server's types that mirror a client result carry their own name (the store's TakeSpec
beside the client's SampleSpec, RecordPage beside PromptPage), and a bound both sides read (a
sample stream's window, the group key of a grouping) lives once, in client/schema/.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Names every module may define for itself: a module's own logger and type variables.
OWN = {"T", "K", "V", "P", "R", "log", "__all__"}


def _defined() -> dict[str, list[str]]:
    """Each top-level class, `check*` function and UPPER_CASE constant of server/ and client/, and where."""
    found: dict[str, list[str]] = collections.defaultdict(list)
    for root in ("server", "client"):
        for path in sorted((ROOT / root).rglob("*.py")):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue
            where = str(path.relative_to(ROOT))
            for node in ast.parse(path.read_text()).body:
                names: list[str] = []
                if (isinstance(node, ast.ClassDef) and not node.name.startswith("_")) or (
                    isinstance(node, ast.FunctionDef) and node.name.startswith("check_")
                ):
                    names = [node.name]
                elif isinstance(node, ast.Assign | ast.AnnAssign):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names = [t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper() and len(t.id) > 1]
                found.update({name: [*found[name], where] for name in names if name not in OWN})
    return found


def test_each_class_and_check_is_defined_in_one_module() -> None:
    twice = {name: places for name, places in _defined().items() if len(places) > 1 and not name.isupper()}
    assert twice == {}


def test_the_names_the_house_review_found_twice_are_each_one_thing() -> None:
    """The ones #65 named: each is defined once now, where its users import it."""
    defined = _defined()
    once = {
        "SampleSpec": "client/rpc/sample_spec.py",
        "TakeSpec": "server/store/schema/sample_spec.py",
        "PromptPage": "client/schema/prompts.py",
        "PromptStats": "client/schema/prompts.py",
        "PromptState": "client/schema/prompts.py",
        "MAX_WINDOW": "client/schema/call_limits.py",
        "GROUP_KEY_OF": "client/schema/routing.py",
        "check_names": "server/store/schema/errors.py",
        "check_count": "server/store/schema/sample_spec.py",
        "LedgerServicer": "server/rpc/servicers/ledger.py",
        "ServiceCalls": "server/store/service_calls.py",
        # constants of one format or default that two or more modules each wrote out
        "ALIGN": "client/rpc/wire.py",
        "COLUMN_TAG": "client/rpc/wire.py",
        "PART_TAG": "client/rpc/wire.py",
        "PAYLOAD_TAG": "client/rpc/wire.py",
        "WHOLE_TAG": "client/rpc/wire.py",
        "VALUES_TAG": "client/rpc/wire.py",
        "DEFAULT_PORT": "client/rpc/connection.py",
        "INT64_MAX": "client/trxp/codec/common.py",
        "MANIFEST": "client/native_build.py",
        "NATIVE": "client/native_build.py",
        "EID_PARTS": "client/schema/experience.py",
        "U32": "server/store/disk/layout.py",
        "U64": "server/store/disk/layout.py",
    }
    assert {name: defined.get(name) for name in once} == {name: [where] for name, where in once.items()}
