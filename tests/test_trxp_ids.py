"""The uid a push's check makes of each experience's eid (RawItem.checked_uid), which the store's
entry takes, with the task, run and step ids read from it, instead of making them again: the very
strings ids_of makes of the eid, for every form of eid the parse accepts, whichever way the push
came (a TRXP payload whole or read as it arrives, a batch of columns). The uid is what tells a
duplicate, a tombstone and a delete apart, so a byte of difference would store an experience twice."""

from __future__ import annotations

import itertools
import json
import pickle
import struct
from typing import Any

import pytest

from expbuf.client import EID, BufferClient, trxp
from expbuf.client.schema.experience import ids_of
from expbuf.client.trxp.codec.parse import head_length, parse_head
from expbuf.client.trxp.column_batch import wire as column_wire
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.server.store import Entry

from conftest import Servers

# Each part at the edges of what the parse accepts: ints at the bounds of int64 and of a machine
# word (where the checks' fast path hands an eid to the detailed one), text that reads as a number,
# non-ASCII text (also the detailed path's), a batch holding '/', empty parts.
INTS = [0, 1, -1, 7, 10**9, (1 << 62) - 1, 1 << 62, -(1 << 62) + 1, -(1 << 62), 2**63 - 1, -(2**63)]
BATCHES: list[int | str] = [*INTS, "", "b", "3/eval", "a/b/c", "é", "٣", "²", "1", "-0", "007", " 1", "x" * 200]
TASKS: list[int | str] = [*INTS, "", "t", "é", "٣", "True", "None", "0x1", "1e3"]
RUNS = [0, 1, 2**31, (1 << 62) - 1, 1 << 62, 2**63 - 1]
STEPS = [0, 1, 2**31 - 1]
SUFFIXES = ["", "s", "é", "0", "a" * 40]
TOKENS = struct.pack("<4q", 5, 6, 7, 8)


def accepted_eids() -> list[dict[str, Any]]:
    """Eids of every form the parse accepts, each part's edges against the others', the keys in
    any order; none whose uid passes MAX_UID_BYTES, which the parse refuses."""
    made = [
        {"batch": batch, "task": task, "run": run, "step": step, "suffix": suffix}
        for (batch, task), (run, step, suffix) in zip(
            itertools.product(BATCHES, TASKS),
            itertools.cycle(itertools.product(RUNS, STEPS, SUFFIXES)),
            strict=False,
        )
    ]
    made += [
        {"batch": batch, "task": 3, "run": run, "step": step, "suffix": suffix}
        for batch, run, step, suffix in itertools.product(["b", -(2**63), "é"], RUNS, STEPS, SUFFIXES)
    ]
    parts = {"batch": "3/eval", "task": -1, "run": 2**63 - 1, "step": 2**31 - 1, "suffix": "é"}
    made += [{key: parts[key] for key in order} for order in itertools.permutations(parts)]
    return [eid for eid in made if len(EID(**eid).uid.encode()) <= trxp.MAX_UID_BYTES]


def payload(eids: list[dict[str, Any]]) -> bytes:
    """A TRXP payload of one experience of 4 tokens an eid, each eid pickled as given (its keys'
    order kept)."""
    items = [{"eid": eid, "reward": 1.0, "info": {}, "metrics": {}, "prompt_length": 1} for eid in eids]
    pickled = pickle.dumps({"version": 1, "num_items": len(items), "items": items}, protocol=5)
    header = {
        f"{index}:tokens": {"dtype": "I64", "shape": [4], "data_offsets": [32 * index, 32 * index + 32]}
        for index in range(len(eids))
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    blob = struct.pack("<Q", len(head)) + head + TOKENS * len(eids)
    return struct.pack("<4sBQQ", b"TRXP", 1, len(pickled), len(blob)) + pickled + blob


def columns(eids: list[dict[str, Any]]) -> bytes:
    """The same experiences as a batch of columns, each eid's ints marked ints (the wire's form)."""
    message = pb.ColumnBatch(
        batches=[str(eid["batch"]) for eid in eids],
        tasks=[str(eid["task"]) for eid in eids],
        runs=[eid["run"] for eid in eids],
        steps=[eid["step"] for eid in eids],
        suffixes=[eid["suffix"] for eid in eids],
        int_batches=isinstance(eids[0]["batch"], int),
        int_tasks=isinstance(eids[0]["task"], int),
    )
    message.columns.add(name="tokens", dtype="I64", items=range(len(eids)), ndim=1, shapes=[4] * len(eids))
    message.columns.add(name="prompt_length", dtype="I64", items=range(len(eids)), ndim=0)
    values = [TOKENS * len(eids), struct.pack(f"<{len(eids)}q", *[1] * len(eids))]
    return b"".join(column_wire.write(message, values))


def expected(eid: dict[str, Any]) -> tuple[str, str, str, str]:
    """The ids ids_of makes of an eid, checked against EID's own properties."""
    made = ids_of(eid)
    whole = EID(**eid)
    assert made == (whole.uid, whole.tid, whole.rid, whole.sid), eid
    return made


def assert_carried(items: list[trxp.RawItem], eids: list[dict[str, Any]]) -> None:
    """Each item carries ids_of's uid of its eid, a plain str; the ids read from it are ids_of's of
    the eid, and its entry's."""
    assert len(items) == len(eids)
    for item, eid in zip(items, eids, strict=True):
        assert type(item.checked_uid) is str and item.checked_uid == expected(eid)[0], eid
        assert ids_of(eid, item.checked_uid) == expected(eid), eid
        entry = Entry.staged(item, b"", b"", 0, 0)
        assert (entry.uid, entry.tid, entry.rid, entry.sid) == expected(eid), eid


def test_a_parse_carries_the_uid_ids_of_makes_of_every_eid_it_accepts() -> None:
    eids = accepted_eids()
    assert len(eids) > 400
    body = payload(eids)
    assert_carried(trxp.parse(body), eids)
    head = body[: head_length(body, len(body))]
    read, _ = parse_head(head, len(body), received=len(body))  # a payload read as it arrives
    assert_carried(read, eids)


def test_an_unchecked_item_carries_no_uid_and_its_entry_makes_the_same_ids() -> None:
    """A payload the server wrote itself is parsed trusted, unchecked: its entry makes the ids."""
    eids = accepted_eids()
    body = payload(eids)
    for checked, trusted, eid in zip(trxp.parse(body), trxp.parse(body, trusted=True), eids, strict=True):
        assert trusted.checked_uid is None
        made, taken = Entry.staged(trusted, b"", b"", 0, 0), Entry.staged(checked, b"", b"", 0, 0)
        assert (made.uid, made.tid, made.rid, made.sid) == (taken.uid, taken.tid, taken.rid, taken.sid), eid


@pytest.mark.parametrize(
    ("batch", "task"), [(-(2**63), 2**63 - 1), ((1 << 62) - 1, 0), ("3/eval", "é"), ("", "t"), ("b", "")]
)
def test_a_batch_of_columns_carries_the_uid_ids_of_makes(batch: int | str, task: int | str) -> None:
    eids = [
        {"batch": batch, "task": task, "run": run, "step": step, "suffix": suffix}
        for run, step, suffix in itertools.product(RUNS, STEPS, SUFFIXES)
    ]
    assert_carried(list(column_wire.read(columns(eids)).items()), eids)


def test_a_server_stores_each_eid_under_ids_of_uid_and_knows_it_again(start_server: Servers) -> None:
    """Pushed to a server, each experience is stored under the uid ids_of makes of its eid; the
    same push again is all duplicates, a delete by those uids removes every one, and the push after
    it stores them again."""
    eids = [eid for eid in accepted_eids() if eid["batch"] != "" or eid["task"] != ""][:300]
    uids = [expected(eid)[0] for eid in eids]
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=30) as client:
        client.create_table("ids")
        pushed = client.push(payload(eids), table="ids")
        assert pushed.stored == uids and pushed.duplicates == []
        again = client.push(payload(eids), table="ids")
        assert again.duplicates == uids and again.stored == []
        assert [exp.eid.uid for exp in client.get(uids, "ids")] == uids
        assert client.delete(uids, "ids") == len(uids)
        assert client.push(payload(eids), table="ids").stored == uids
