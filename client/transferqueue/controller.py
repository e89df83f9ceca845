"""TransferQueue's controller with its state kept in expbuf, so that a controller started again
after a crash (kill -9 of its Ray actor, of the job, or of the expbuf server under it) comes back
to exactly the state its last answered request left: which indexes each partition holds, which
fields of which sample were produced, what each task consumed, custom metadata, keys, sampler
state. Nothing produced is lost, nothing consumed is handed out again.

How: `DurableController` is TransferQueue's own controller class with one seam added where all its
requests pass (`_handle_request`). Each request that changes state is journalled (journal.py)
before its reply is sent: a request whose effect follows from the state and its body (inserts,
production updates, custom metadata, clearing, consumption resets, key creation) as its body, and
a fetch as its sampler call and the samples it marked consumed. Every `snapshot_every` entries the
controller's state, as TransferQueue's own checkpoint writes it, replaces the entries before it.
Started again, the controller loads the snapshot with TransferQueue's own checkpoint loader and
replays the entries after it, before any client can reach it.

TransferQueue's `init` names its controller class at one module attribute,
`transfer_queue.interface.TransferQueueController`; importing this package (as choosing the
"Expbuf" backend does) points it at `DurableController`. That is the one patch made to
TransferQueue. The controller journals when the backend is "Expbuf" or `controller.Expbuf` is
configured (`target` or `shards`, `table`, `token`, `snapshot_every`, `wait_s`; each defaults to
`backend.Expbuf`'s), and behaves exactly as TransferQueue's otherwise.

TransferQueue hands a fetched sample out once (a fetch marks it consumed when it answers), so a
consumer that dies between a fetch and its training loses that batch, as TransferQueue does
without expbuf; `get_consumption_status` shows such samples as consumed and, until cleared, still
stored. A journal write the server has not answered (away past `wait_s`, its answer lost) may have
been kept, so it is made again until the server answers (journal.py), and the request is answered
after it; one the server refuses stops the controller answering: start it again, and it comes back
from what was acknowledged.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import ray
import transfer_queue.interface
from transfer_queue.controller import TransferQueueController
from transfer_queue.sampler import BaseSampler, SequentialSampler
from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType

from . import pickles
from .journal import Journal
from .storage import BACKEND, WAIT_SECONDS, Server, connect, open_table, server_of

REPLAYED = frozenset(
    {
        ZMQRequestType.NOTIFY_DATA_UPDATE,
        ZMQRequestType.SET_CUSTOM_META,
        ZMQRequestType.MARK_CLEARING,
        ZMQRequestType.CLEAR_META,
        ZMQRequestType.CLEAR_PARTITION,
        ZMQRequestType.RESET_CONSUMPTION,
    }
)  # requests whose effect follows from the state and their body alone
JOURNAL_SENDER = "expbuf-journal"
T = TypeVar("T")


@dataclass(frozen=True)
class JournalSettings:
    """Where the controller keeps its journal, from TransferQueue's config."""

    where: Server  # the server, or its shards, the journal is kept on
    table: str
    snapshot_every: int = 1000
    wait_s: float = WAIT_SECONDS

    @classmethod
    def from_conf(cls, conf: Any) -> JournalSettings | None:
        """The settings `controller.Expbuf` names over `backend.Expbuf`'s; None where the
        controller keeps no journal (another backend and no `controller.Expbuf`, or `journal:
        false` there)."""
        backend = conf.get("backend") or {}
        own = dict((conf.get("controller") or {}).get(BACKEND) or {})
        stored = dict(backend.get(BACKEND) or {}) if backend.get("storage_backend") == BACKEND else {}
        if not (own or stored) or own.get("journal", True) is False:
            return None
        merged = {**stored, **own}
        if own.get("target") or own.get("shards"):  # the controller's own server replaces the backend's
            merged = {**{k: v for k, v in stored.items() if k not in ("target", "shards")}, **own}
        return cls(
            where=server_of(merged, f"controller.{BACKEND}"),
            table=str(merged.get("table") or "transfer_queue"),
            snapshot_every=int(merged.get("snapshot_every", 1000)),
            wait_s=float(merged.get("wait_s", WAIT_SECONDS)),
        )


class RecordingSampler(BaseSampler):
    """The configured sampler, with the calls of the request being handled recorded, so that a
    fetch is journalled as what its sampler was asked and what it marked consumed."""

    def __init__(self, inner: BaseSampler) -> None:
        self.inner = inner
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any], list[int], list[int]]] = []

    @classmethod
    def around(cls, sampler: Any) -> Any:
        """A sampler or sampler class as TransferQueue's controller takes one, recorded; anything
        else as it is, for the controller to refuse in its own words."""
        if isinstance(sampler, type) and issubclass(sampler, BaseSampler):
            sampler = sampler()
        return cls(sampler) if isinstance(sampler, BaseSampler) else sampler

    def sample(self, *args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        batch, consumed = self.inner(*args, **kwargs)
        asked = {name: value for name, value in kwargs.items() if name != "partition"}
        self.calls.append((args, asked, list(batch), list(consumed)))
        return batch, consumed

    def has_cached_result(self, partition_id: str, task_name: str, sampling_config: Any = None) -> bool:
        return self.inner.has_cached_result(partition_id, task_name, sampling_config)

    def clear_cache(self, partition_id: str) -> None:
        self.inner.clear_cache(partition_id)

    def save_checkpoint(self) -> dict:
        return self.inner.save_checkpoint()

    def load_checkpoint(self, state: dict) -> None:
        self.inner.load_checkpoint(state)


def _journalled(request: ZMQMessage) -> bool:
    """Whether a request is journalled by its body (a fetch is journalled by its sampler's calls)."""
    kind, body = request.request_type, request.body
    if kind == ZMQRequestType.GET_META:
        return bool(body.get("mode", "fetch") == "insert")
    return kind in REPLAYED or (kind == ZMQRequestType.KV_RETRIEVE_META and bool(body.get("create")))


class _Unmeasured:
    """The monitor a replayed request is handled under: it measures nothing."""

    def measure(self, **_: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class DurableController(TransferQueueController.__ray_actor_class__):
    """TransferQueue's controller, journalled in expbuf once its config names where."""

    def __init__(self, sampler: BaseSampler | type[BaseSampler] = SequentialSampler, polling_mode: bool = False):
        self._journal: Journal | None = None
        self._stopped: str | None = None
        self._lock = threading.Lock()  # the request thread's journal against register_sampler's
        self._recorder = RecordingSampler.around(sampler)
        super().__init__(sampler=self._recorder, polling_mode=polling_mode)

    def register_sampler(self, sampler: BaseSampler | type[BaseSampler] = SequentialSampler) -> None:
        """TransferQueue's, its state then snapshotted (a restart takes the sampler TransferQueue's
        config names, with the state the registered one had)."""
        with self._lock:
            self._recorder = RecordingSampler.around(sampler)
            super().register_sampler(self._recorder)
            if self._journal is not None:
                self._durably(self._snapshot)

    def store_config(self, conf: Any) -> None:
        """TransferQueue's init stores its config before any client can reach the controller:
        the state comes back from the journal here, the first time."""
        if self._journal is None:
            settings = JournalSettings.from_conf(conf)
            if settings is not None:
                # each journal write waits up to wait_s, and one unanswered is made again (journal.py)
                client = connect(settings.where, settings.wait_s)
                open_table(client, settings.table, f"controller.{BACKEND}")
                journal = Journal(client, settings.table, settings.snapshot_every)
                self._restore(*journal.load())
                self._journal = journal
        super().store_config(conf)

    def journalled(self) -> int:
        """How many entries the journal holds past its snapshot (0 without a journal)."""
        return 0 if self._journal is None else self._journal.seq - self._journal.head.seq

    def _restore(self, snapshot: bytes | None, entries: list[bytes]) -> None:
        """The snapshot loaded, then the entries after it replayed; each loaded with only the
        names pickles.py allows (a table's keyed values are any push token's to write), so the
        snapshot is handed to TransferQueue's own loader as it loads back, pickled anew here."""
        if snapshot is not None:
            state = pickles.loads(snapshot, "the controller's snapshot")
            with self._state_file() as path:
                with open(path, "wb") as file:
                    pickle.dump(state, file, protocol=pickle.HIGHEST_PROTOCOL)
                self.load_checkpoint(path)
        for at, entry in enumerate(entries, 1):
            for op in pickles.loads(entry, f"the controller's journal entry {at} after its snapshot"):
                self._replay(op)

    def _replay(self, op: tuple[Any, ...]) -> None:
        """Do again what a journalled request did; it fails again where it failed first."""
        if op[0] == "request":
            message = ZMQMessage.create(ZMQRequestType(op[1]), sender_id=JOURNAL_SENDER, body=op[2])
            with contextlib.suppress(Exception):
                super()._handle_request(message, _Unmeasured())
            return
        _, partition_id, task_name, args, asked, batch, consumed = op
        partition = self.partitions.get(partition_id)
        with contextlib.suppress(Exception):
            self._recorder.inner(*args, partition=partition, **asked)
        if batch and consumed and partition is not None:
            partition.mark_consumed(task_name, consumed)

    def _handle_request(self, request_msg: ZMQMessage, monitor: Any) -> ZMQMessage | None:
        if self._stopped is not None:
            raise RuntimeError(self._stopped)
        if self._journal is None:
            return super()._handle_request(request_msg, monitor)
        with self._lock:
            if request_msg.request_type == ZMQRequestType.GET_META or _journalled(request_msg):
                pickles.dumps(request_msg.body)  # a body the journal could not keep: refused before it changes anything
            self._recorder.calls.clear()
            try:
                return super()._handle_request(request_msg, monitor)
            finally:
                self._record(request_msg)

    def _record(self, request: ZMQMessage) -> None:
        """Journal what `request` changed, before its reply goes."""
        kind, body = request.request_type, request.body
        ops: list[tuple[Any, ...]] = []
        if kind == ZMQRequestType.GET_META and body.get("mode", "fetch") != "insert":
            ops.extend(
                ("sample", body["partition_id"], body.get("task_name"), args, asked, batch, consumed)
                for args, asked, batch, consumed in self._recorder.calls
            )
        elif _journalled(request):
            ops.append(("request", kind.value, body))
        elif kind == ZMQRequestType.LOAD_CONTROLLER_CHECKPOINT:
            self._durably(self._snapshot)
        if ops:
            self._write(ops)

    def _write(self, ops: list[tuple[Any, ...]]) -> None:
        """Append the request's entry, or where it is more than a put carries, take a snapshot
        that holds it; either durable before the reply goes, or the controller stops and the
        request fails. A snapshot merely due that fails stops the controller after this reply:
        the entry is durable, so the change it answers for stands."""
        assert self._journal is not None
        journal = self._journal
        entry = self._durably(lambda: pickles.dumps(ops))
        if not self._durably(lambda: journal.append(entry)):
            self._durably(self._snapshot)
        elif journal.due:
            try:
                self._snapshot()
            except Exception as exc:
                self._stopped = self._stop_message(exc)

    def _durably(self, step: Callable[[], T]) -> T:
        """`step`'s result; where it fails, the controller answers nothing more (its state in
        memory may hold a change the journal does not)."""
        try:
            return step()
        except Exception as exc:
            self._stopped = self._stop_message(exc)
            raise RuntimeError(self._stopped) from exc

    @staticmethod
    def _stop_message(exc: Exception) -> str:
        return (
            f"the controller could not journal a change in expbuf ({type(exc).__name__}: {exc}); it answers "
            "nothing more: start it again, and its state comes back from what was acknowledged"
        )

    def _snapshot(self) -> None:
        """The state as TransferQueue's own checkpoint writes it, stored as the journal's snapshot;
        then loaded back into this controller, so that its state is the very one a restart loads
        (TransferQueue hands out reused indexes in the order of its sets, which a set rebuilt by
        loading may iterate otherwise than the set it was saved from). A state a restart could
        not load (pickles.py: a sampler's state of a type of its own) is refused here, while the
        controller still holds it, never stored."""
        assert self._journal is not None
        with self._state_file() as path:
            self.save_checkpoint(path)
            with open(path, "rb") as file:
                state = file.read()
            pickles.loads(state, "the controller's snapshot")
            self._journal.snapshot(state)
            self.load_checkpoint(path)

    @staticmethod
    @contextlib.contextmanager
    def _state_file() -> Iterator[str]:
        with tempfile.TemporaryDirectory(prefix="expbuf-tq-") as folder:
            yield os.path.join(folder, "controller_state.pkl")


DurableControllerActor = ray.remote(num_cpus=1)(DurableController)
transfer_queue.interface.TransferQueueController = DurableControllerActor
