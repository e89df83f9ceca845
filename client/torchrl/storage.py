"""A TorchRL replay-buffer storage whose data lives in an expbuf table.

`extend` and `add` push each element (a dialog turn) as an experience, durable when they
return; the server groups them, computes the table's advantages when a group completes, and
`ExpbufSampler` draws whole groups back. The storage itself keeps only the batch drawn last,
which TorchRL's `ReplayBuffer` reads through `get`; its `state_dict` says where the data is
(target and table), not a copy of it.

Groups are named as TorchRL's MCAdvantage names them: by the value at `group_key` (the prompt,
"query", by default). The first `group_size` elements of a name pushed into the table, by any
writer on any machine, are its group 0, the next ones its group 1, and so on: the eid of an
element is batch = that round, task = a digest of the name, run = its place in the round as its
writer counts it (0 .. group_size - 1 in the order written; the members of one push in a table
of group_size 0), suffix = an `ordered_id` of its own. A writer keeps the open round of the
names it wrote; a round the server reports complete (another writer filled it) is passed.
Writers that share a round each count their own places, so their runs there may repeat (the
suffix keeps their uids apart): the server's group needs none of them.

The table, not the storage, decides what is kept (its capacity settings: capacity_experiences,
when_full): the storage has no `max_size` (refused by name, and so is TorchRL's positional
max_size where the target goes: `ExpbufStorage(100)`), and the positions TorchRL's writer
picks mean nothing here, so only its round-robin writers are taken (the default ones): another
writer, TensorDictMaxValueWriter say, is refused by name at the first write rather than ignored.
"""

from __future__ import annotations

import inspect
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

from tensordict import NestedKey, TensorDictBase
from torchrl.data.replay_buffers.checkpointers import StorageCheckpointerBase
from torchrl.data.replay_buffers.storages import LazyStackStorage, Storage
from torchrl.data.replay_buffers.writers import RoundRobinWriter

from expbuf.client.client import BufferClient
from expbuf.client.errors import FailedPreconditionError
from expbuf.client.kit.tables import table_info
from expbuf.client.results import Batch, TableInfo
from expbuf.client.schema.experience import EID, Experience, ordered_id
from expbuf.client.schema.reasons import Reason
from expbuf.client.trxp.codec.gc_pause import collector_paused

from . import convert

BOUNDED = "the table's capacity settings (capacity_experiences, when_full) bound what it keeps"
ROUNDS_KEPT = 1 << 16  # group names whose open round a writer remembers (the least recent forgotten)
STATE_FILE = "expbuf.json"


class _Rounds:
    """The round each group name is open at, and how many members this writer put into it."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._open: OrderedDict[str, tuple[int, int]] = OrderedDict()  # task -> (round, members)

    def plan(self, task: str, count: int) -> list[tuple[int, int]]:
        """The (round, run) of `count` new members: the open round while it has room, then the next
        ones, each member's run its place in its round. A table that completes groups on push takes
        each push's members as one group, runs 0 .. count - 1. The same state plans the same places:
        a push made again before `stored` or `closed` (after a refusal) has the same uids."""
        round_, members = self._open.get(task, (0, 0))
        if not self.group_size:
            return [(round_, i) for i in range(count)]
        places = range(members, members + count)
        return [(round_ + place // self.group_size, place % self.group_size) for place in places]

    def stored(self, task: str, count: int) -> None:
        round_, members = self._open.get(task, (0, 0))
        if self.group_size:
            round_, members = round_ + (members + count) // self.group_size, (members + count) % self.group_size
        else:
            round_, members = round_ + 1, 0
        self._set(task, (round_, members))

    def closed(self, task: str, round_: int) -> None:
        """The server refused round `round_` as complete: another writer filled it."""
        self._set(task, (round_ + 1, 0))

    def _set(self, task: str, value: tuple[int, int]) -> None:
        self._open[task] = value
        self._open.move_to_end(task)
        while len(self._open) > ROUNDS_KEPT:
            self._open.popitem(last=False)


def _closed_group(exc: FailedPreconditionError) -> bool:
    """Whether the server refused a push because a group of it is complete, or too full for it."""
    return exc.reason in (Reason.GROUP_CLOSED, Reason.GROUP_OVERFILLED)


class _Checkpointer(StorageCheckpointerBase):
    """`ReplayBuffer.dumps` and `loads`: the storage's state dict as JSON (where the data is)."""

    def dumps(self, storage: ExpbufStorage, path: str | Path) -> None:
        write_state(storage.state_dict(), path)

    def loads(self, storage: ExpbufStorage, path: str | Path) -> None:
        storage.load_state_dict(read_state(path))


def write_state(state: dict[str, Any], path: str | Path) -> None:
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / STATE_FILE).write_text(json.dumps(state))


def read_state(path: str | Path) -> dict[str, Any]:
    return dict(json.loads((Path(path) / STATE_FILE).read_text()))


class ExpbufStorage(LazyStackStorage):
    """TorchRL storage over the expbuf table `table` at `target` (HOST:PORT).

    `group_key` names the entry that names an element's group (MCAdvantage's `prompt_key`);
    `connection` goes to `BufferClient` (token, tls, timeout, retries, wait_for_ready,
    max_message_bytes); its calls wait for a server that restarts until their deadline,
    `timeout`, unless `wait_for_ready=False`.
    The table must group by task. Use it with `ExpbufSampler`:

    ```python
    rb = ReplayBuffer(storage=ExpbufStorage("10.0.0.5:50051", "grpo8"), sampler=ExpbufSampler())
    ```
    """

    _default_checkpointer = _Checkpointer

    def __init__(
        self, target: str, table: str = "default", *, group_key: NestedKey = "query", **connection: Any
    ) -> None:
        if "max_size" in connection:
            raise TypeError(f"ExpbufStorage has no max_size: {BOUNDED}")
        if not isinstance(target, str):  # TorchRL's storages take max_size first: ListStorage(100)
            raise TypeError(
                f"ExpbufStorage({target!r}): its first argument is the server's target (HOST:PORT), not a "
                f"max_size as TorchRL's storages take first; it has no max_size: {BOUNDED}"
            )
        if not isinstance(table, str):
            raise TypeError(f"ExpbufStorage: table is {table!r}; it must be a table's name (a str)")
        super().__init__(max_size=None)
        self.target = target
        self.table = table
        self.group_key = group_key
        self._connection = {"wait_for_ready": True, **connection}
        inspect.signature(BufferClient).bind(target, **self._connection)  # a wrong name is refused now
        self._client: BufferClient | None = None
        self._info: TableInfo | None = None
        self._rounds: _Rounds | None = None

    @property
    def client(self) -> BufferClient:
        """The client of this storage (its own channel, opened on first use)."""
        if self._client is None:
            self._client = self.connect()
        return self._client

    def connect(self) -> BufferClient:
        """A new client of the same server, with the same settings."""
        return BufferClient(self.target, **self._connection)

    def table_info(self) -> TableInfo:
        """The table's settings, read once; a table that does not group by task is refused."""
        if self._info is None:
            info = table_info(self.client, self.table, make_it="with group_by = 'task'")
            if info.group_by != "task":
                raise ValueError(
                    f"expbuf table {self.table!r} has group_by={info.group_by!r}: a TorchRL storage groups "
                    "elements by their group name, so the table needs group_by = 'task'"
                )
            self._info = info
        return self._info

    # ------------------------------------------------------------------ writing

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Push the elements of `data` (the positions TorchRL's writer chose mean nothing here)."""
        self._refuse_other_writers()
        named = [(*convert.group_name(element, self.group_key), element) for element in convert.elements(data)]
        if self._rounds is None:
            self._rounds = _Rounds(self.table_info().group_size)
        by_task: dict[str, list[tuple[str | list[Any], TensorDictBase]]] = {}
        for task, group, element in named:
            by_task.setdefault(task, []).append((group, element))
        pending = {task: [self._experience(task, g, e) for g, e in members] for task, members in by_task.items()}
        try:
            self._push(pending)
        except FailedPreconditionError as exc:
            if not _closed_group(exc):
                raise
            for task, exps in pending.items():
                self._push_group(task, exps)
        self._bump_mutation_revision()

    def readers(self) -> list[Any]:
        """The TorchRL buffers reading this storage (each attaches itself to its storage when made)."""
        return list(self._attached_entities_iter())

    def _refuse_other_writers(self) -> None:
        """A writer of a buffer reading this storage that is not round-robin would have no effect."""
        for buffer in self.readers():
            writer = getattr(buffer, "writer", None)
            if writer is not None and not isinstance(writer, RoundRobinWriter):
                raise ValueError(
                    f"{type(writer).__name__} has no effect on an expbuf storage: every element given is pushed, and "
                    "the table's capacity settings decide what it keeps; use the buffer's default writer"
                )

    def _experience(self, task: str, group: str | list[Any], element: TensorDictBase) -> Experience:
        return convert.to_experience(element, EID(task=task, suffix=ordered_id()), group, self.group_key)

    def _push(self, pending: dict[str, list[Experience]]) -> None:
        """One push of every group's members into the rounds this writer knows to have room, each
        member's run its place there."""
        assert self._rounds is not None
        for task, exps in pending.items():
            for exp, (round_, run) in zip(exps, self._rounds.plan(task, len(exps)), strict=True):
                exp.eid.batch, exp.eid.run = round_, run
        self.client.push([exp for exps in pending.values() for exp in exps], self.table)
        for task, exps in pending.items():
            self._rounds.stored(task, len(exps))

    def _push_group(self, task: str, exps: list[Experience]) -> None:
        """A group name's members after a refusal: all at once, else one by one, each into the
        first round the server finds open."""
        assert self._rounds is not None
        while True:
            try:
                self._push({task: exps})
                return
            except FailedPreconditionError as exc:
                if not _closed_group(exc):
                    raise
                if len(exps) > 1:  # fewer fit than this writer thought: one at a time
                    for exp in exps:
                        self._push_group(task, [exp])
                    return
                self._rounds.closed(task, int(exps[0].eid.batch))

    # ------------------------------------------------------------------ reading

    def hold(self, batch: Batch) -> int:
        """Keep a drawn batch's elements for `get`; returns how many there are. Its TensorDicts are
        made without the garbage collector's passes, as a batch is decoded (gc_pause.py): they make
        and drop a few dozen objects an element, which the passes moved into the collector's oldest
        generation (1.6x the CPU of making them without it, bench/RESULTS.md)."""
        experiences = batch.experiences
        with collector_paused():
            self._storage = convert.to_elements(experiences, self.group_key, batch.advantage_values)
        self._bump_mutation_revision()
        return len(self._storage)

    def get(self, index: Any) -> Any:
        if not self._storage:
            raise IndexError(
                f"an expbuf storage keeps no local copy of table {self.table!r}: only the batch an "
                "ExpbufSampler drew last can be read"
            )
        return super().get(index)

    def __len__(self) -> int:
        """The table's ready experiences (complete groups not yet delivered)."""
        return self.client.stats(self.table)[self.table].ready

    def _empty(self) -> None:
        """Forget the batch drawn last. The table keeps its data (delete it with expbuf's admin calls)."""
        self._storage = []
        self._bump_mutation_revision()

    # ------------------------------------------------------------------ where the data is

    def state_dict(self) -> dict[str, Any]:
        return {"target": self.target, "table": self.table}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Point this storage at the table a state dict names."""
        missing = {"target", "table"} - set(state_dict)
        if missing:
            raise ValueError(f"an expbuf storage's state dict names target and table; missing {sorted(missing)}")
        if state_dict["target"] != self.target:
            self.close()
            self.target = state_dict["target"]
        self.table = state_dict["table"]
        self._info, self._rounds, self._storage = None, None, []
        self._bump_mutation_revision()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __getstate__(self) -> dict[str, Any]:
        """Picklable for other processes (a collector's): the channel and the drawn batch stay here."""
        state = Storage.__getstate__(self)
        state.update(_client=None, _storage=[], _rounds=None)
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(target={self.target!r}, table={self.table!r}, group_key={self.group_key!r})"


__all__ = ["ExpbufStorage", "read_state", "write_state"]
