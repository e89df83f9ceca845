"""A Trinity-RFT taskset read from an expbuf dataset of prompts (the prompt ledger).

Trinity's explorer reads its taskset through `get_buffer_reader`; for a taskset whose path is
`expbuf://HOST:PORT/TABLE?dataset=NAME&source=PATH` the plugin gives it ExpbufTaskset. Each read
claims prompt indexes from the ledger (prompts sent back first, then the dataset's durable
cursor) and reads those rows of the user's own taskset, `source`, with Trinity's file reader,
so the tasks are the ones Trinity would make of them. The cursor lives in expbuf, not in the
explorer's checkpoint: an explorer killed between checkpoints neither skips nor repeats a
prompt. Its claims are renewed while it lives (claims.py) and go out again, with their next
attempt, when it dies.

A task carries its prompt in `task.index["expbuf"]` (EID batch and task); Trinity copies
`task.index` into each experience's `info["task_index"]`, and the plugin's writer gives the
experiences the prompt's EID (Trinity's workflow runner sets `eid.batch` to the explore step),
so that they make the prompt's group. The explorer's loop ends (StopAsyncIteration) when the
ledger says the dataset is done, or when nothing is left to generate but explorers' tasks (its
own, and those of other explorers reading the dataset), which each then finishes: Trinity writes
a step's experiences only after its next read.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import os
import socket
import uuid
import weakref
from collections import deque
from typing import Any

from trinity.buffer.buffer_reader import BufferReader
from trinity.buffer.reader.file_reader import TaskFileReader
from trinity.common.config import StorageConfig
from trinity.common.constants import StorageType

from expbuf.client.errors import BufferError, NotFoundError, PermissionDeniedError
from expbuf.client.kit.location import connect, parse
from expbuf.client.kit.retry import retried
from expbuf.client.schema.prompts import DatasetInfo, Prompt, new_claim_id

from .claims import RENEWALS_PER_CLAIM, ClaimKeeper

log = logging.getLogger(__name__)
TASK_INDEX_KEY = "expbuf"  # task.index[TASK_INDEX_KEY] = {"batch": ..., "task": ...}
# How long one claim waits for a prompt before the reader asks whether it should stop.
POLL_SECONDS = 1.0
OWNER_PREFIX = "trinity-explorer-"  # the owner of an explorer's claims: its host, pid, a nonce
STEPS_KEPT = 64  # steps read awaiting feedback: Trinity's explorer has a few in flight


def prompt_eid(info: Any) -> tuple[str, str] | None:
    """The prompt EID (batch, task) an experience's `info` carries from its task, if any."""
    index = info.get("task_index") if isinstance(info, dict) else None
    prompt = index.get(TASK_INDEX_KEY) if isinstance(index, dict) else None
    if not isinstance(prompt, dict):
        return None
    batch, task = prompt.get("batch"), prompt.get("task")
    return (batch, task) if isinstance(batch, str) and isinstance(task, str) else None


def _rows(config: StorageConfig, source: str) -> TaskFileReader:
    """Trinity's own reader of a file taskset at `source`, read by index (never by its cursor)."""
    rows = copy.copy(config)
    rows.path, rows.storage_type = source, StorageType.FILE.value
    rows.index, rows.total_epochs, rows.total_steps, rows.is_eval = 0, 1, None, False
    rows.enable_progress_bar, rows.data_selector = False, None
    return TaskFileReader(rows)


class ExpbufTaskset(BufferReader):
    """Trinity tasks of the prompts claimed from an expbuf dataset, at most `batch_size` a read."""

    def __init__(self, config: StorageConfig) -> None:
        self.location = parse(config.path)
        self.name = config.name
        self._check_config(config)
        self.batch_size = config.batch_size
        self._rows = _rows(config, self.location.source)
        self._size = len(self._rows)
        self._client = connect(self.location)
        self._check_dataset(config.total_epochs)
        self._owner = f"{OWNER_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        keeper = connect(self.location, timeout=self.location.lease_seconds / RENEWALS_PER_CLAIM)
        self._keeper = ClaimKeeper(keeper, self.location.lease_seconds, self.location.hold_seconds)
        weakref.finalize(self, self._keeper.close)  # a reader dropped unclosed renews nothing more
        self._sees_ledger = True  # False once the token proved unable to read it (no sample scope)
        self._tasks_read = 0
        # the prompts of each step read, awaiting its feedback (a driver that gives none keeps the last few)
        self._steps: deque[list[Prompt]] = deque(maxlen=STEPS_KEPT)

    def _check_config(self, config: StorageConfig) -> None:
        where = f"taskset '{self.name}' ({self.location.table}?dataset={self.location.dataset})"
        if not self.location.dataset:
            raise ValueError(
                f"taskset '{self.name}': an expbuf:// taskset reads a dataset of prompts; name it and its rows "
                "in the path: expbuf://HOST:PORT/TABLE?dataset=NAME&source=PATH"
            )
        if config.is_eval:
            raise ValueError(f"{where}: an eval taskset reads every task at each evaluation; give it its source path")
        if config.total_steps is not None:
            raise ValueError(
                f"{where}: buffer.total_steps={config.total_steps}: the dataset's epochs end the explorer; "
                "leave total_steps unset"
            )
        selector = getattr(config.data_selector, "selector_type", "sequential")
        if selector != "sequential":
            raise ValueError(
                f"{where}: data_selector {selector}: the dataset orders its prompts (its seed); leave the selector out"
            )

    def _check_dataset(self, epochs: int) -> None:
        """The dataset must exist with one prompt per row of the source and Trinity's epochs."""
        location = self.location
        try:
            info = self._client.ledger(location.table, location.dataset)
        except NotFoundError:
            raise ValueError(
                f"taskset '{self.name}': table '{location.table}' at {location.target} has no dataset "
                f"'{location.dataset}': create it, one prompt per row of {location.source}: `expbuf dataset create "
                f"{location.table} {location.dataset} {self._size} epochs={epochs}`"
            ) from None
        except PermissionDeniedError:
            log.warning("expbuf: this token cannot read dataset '%s' (no sample scope): not checked", location.dataset)
            return
        if info.size != self._size:
            raise ValueError(
                f"taskset '{self.name}': dataset '{location.dataset}' has {info.size} prompts and its source "
                f"{location.source} {self._size} rows: one prompt per row"
            )
        if info.epochs != epochs:
            raise ValueError(
                f"taskset '{self.name}': dataset '{location.dataset}' has epochs={info.epochs} and "
                f"buffer.total_epochs is {epochs}: set them alike"
            )

    async def read(self, batch_size: int | None = None, **kwargs: Any) -> list:
        """The tasks of up to `batch_size` prompts claimed now (fewer while the dataset's
        max_in_flight holds them back), waiting for one; StopAsyncIteration when the dataset is
        done, or nothing is left to generate but explorers' tasks."""
        size = batch_size or self.batch_size
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"batch_size must be a positive number of tasks, got {size!r}")
        prompts = await asyncio.to_thread(self._claim, size)
        if prompts is None:
            raise StopAsyncIteration(f"expbuf dataset '{self.location.dataset}': no prompt left to generate")
        tasks = [self._task(prompt) for prompt in prompts]
        self._tasks_read += len(tasks)
        self._steps.append(prompts)
        return tasks

    def step_written(self) -> None:
        """The oldest step read has its feedback: its experiences are written. A prompt of it whose
        claim is still held made no complete group (every run failed): it is released, to go out
        again at its next attempt at the next read, rather than held for `hold_seconds` (and, at the
        run's end, left untrained). Trinity's scheduler of one taskset gives it (scheduler.py)."""
        if not self._steps:
            return
        step = set(self._steps.popleft())  # the prompts the keeper holds, as it was given them
        left = [p for p in self._keeper.held() if p in step]
        if not left:
            return
        log.warning(
            "expbuf: %d tasks of a step made no complete group, their runs failed (%s); their prompts go out again",
            len(left), ", ".join(f"{p.batch}/{p.task}" for p in left),
        )  # fmt: skip
        self._keeper.let_go(left)
        try:
            self._client.release_claims(left)
        except BufferError as exc:
            log.warning("expbuf: %d claims not released (%s); they end within a claim", len(left), exc)

    def _claim(self, size: int) -> list[Prompt] | None:
        location = self.location
        while True:  # a server that restarts is waited for (a claim whose reply was lost: answered again)
            claim = retried(
                functools.partial(
                    self._client.claim, location.table, location.dataset, size, lease_seconds=location.lease_seconds,
                    owner=self._owner, wait=POLL_SECONDS, claim_id=new_claim_id(),  # each try of it under one id
                ),
                self._client.timeout,
            )  # fmt: skip
            if claim.prompts:
                self._keeper.hold(claim.prompts)
                return claim.prompts
            if claim.done or self._nothing_to_wait_for():
                return None

    def _ledger(self) -> DatasetInfo:
        """The dataset's ledger, asked again while the server is unavailable (for the client's timeout)."""
        return retried(lambda: self._client.ledger(self.location.table, self.location.dataset), self._client.timeout)

    def _nothing_to_wait_for(self) -> bool:
        """Whether no prompt waits to go out and every claim is an explorer's: this reader's own,
        or another explorer's reading the dataset, which writes its unwritten steps once its own
        loop ends (two explorers waiting for each other's claims would wait for ever). A rollout
        worker's claim is waited for: its prompt may come back. The counts are read before the
        claims held (none is taken meanwhile), so that a claim that ends in between is not taken
        for another claimant's, and again after another's claims are listed, for the same reason.
        Refused when the dataset's max_in_flight is full of this reader's own claims alone: its
        explorer writes them only after this read, which would wait for ever."""
        if not self._sees_ledger:
            return False
        try:
            info = self._ledger()
        except PermissionDeniedError:
            log.warning("expbuf: this token cannot read the dataset (no sample scope); the explorer ends once done")
            self._sees_ledger = False
            return False
        claimed, generated = info.total("claimed"), info.total("generated")
        mine = claimed <= len(self._keeper.held())
        if info.max_in_flight and claimed + generated >= info.max_in_flight:
            if mine and not generated:
                raise ValueError(
                    f"taskset '{self.name}': dataset '{self.location.dataset}' has max_in_flight="
                    f"{info.max_in_flight} and this explorer holds all {claimed} of its claims in steps it has not "
                    "written (Trinity writes a step after its next read), so no trainer can make room: set "
                    f"max_in_flight to at least batch_size ({self.batch_size}) x (the explorer's steps in flight + 1)"
                )
            return False  # the trainer makes room
        if info.total("pending"):
            return False
        if mine:
            return True
        if not self._explorers_hold_every_claim():
            return False
        return not self._ledger().total("pending")

    def _explorers_hold_every_claim(self) -> bool:
        """Whether every claim on the dataset is a Trinity explorer's (its owner names one)."""
        table, dataset, after = self.location.table, self.location.dataset, None
        while True:
            page = self._client.list_prompts(table, dataset, states=["claimed"], after=after)
            if any(not prompt.owner.startswith(OWNER_PREFIX) for prompt in page.prompts):
                return False
            if page.done or page.after is None:
                return True
            after = page.after

    def _task(self, prompt: Prompt) -> Any:
        """Trinity's task of the prompt's row, as its file reader makes it, carrying the prompt's EID."""
        rows = self._rows
        (task,) = rows._convert_batch([rows.dataset.dataset[prompt.index]], [prompt.index])
        task.index[TASK_INDEX_KEY] = {"batch": prompt.batch, "task": prompt.task}
        return task

    def state_dict(self) -> dict[str, Any]:
        """What Trinity saves in the explorer's checkpoint; the cursor itself is the ledger's."""
        return {"current_index": self._tasks_read}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._tasks_read = int(state_dict.get("current_index", 0))

    def __len__(self) -> int:
        return self._size

    def close(self) -> None:
        """Stop renewing the claims held (they end within one claim) and close the connection.
        Trinity never calls it: the renewals also stop when the reader is collected, and with
        its process."""
        self._keeper.close()
        self._client.close()
