"""Trinity-RFT's data selector `expbuf`: a file taskset's tasks chosen by an expbuf dataset's
claim order, so that a curriculum survives restarts.

Trinity's own `difficulty_based` selector keeps its Beta posteriors in memory (its state_dict is
its position alone) and starts over after a restart. This one claims each step's prompts from a
dataset of the prompt ledger, whose order (`pools`, `pass_rate`, or the permutation) reads each
prompt's durable statistics, and reports the feedback Trinity's experience pipeline gives (each
task's mean reward, the `pass_rate_calculator` operator's) as the prompt's outcome, one run whose
reward is that mean, which trains it and updates its statistics in the same transaction. Each
feedback is matched to the oldest step it names; a task of that step it does not name (every run
failed, no experience) is released, to go out again. Trinity's TasksetScheduler drives it and
reads buffer.total_epochs x rows / batch_size steps, no more, so a released prompt goes out again
on top of a later step (one task more than batch_size for each): in the place of another, that
other would never go out. One released after the last read cannot, and the last feedback names
it. The dataset keeps the cursor, the claims and the statistics; `state_dict` holds the counts of
the tasks asked for and owed. The claims are renewed while the explorer lives and end when it
dies, their prompts going out again.

```yaml
buffer:
  explorer_input:
    taskset:
      path: /data/math
      data_selector:
        selector_type: expbuf
        kwargs: {path: "expbuf://10.0.0.5:50051/grpo8", dataset: math, order: pools}
```
"""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import uuid
import weakref
from collections import deque
from typing import Any

from trinity.buffer.selector.selector import BaseSelector

from expbuf.client.errors import BufferError, NotFoundError, PermissionDeniedError
from expbuf.client.kit.location import connect, is_expbuf_path, parse
from expbuf.client.kit.retry import retried
from expbuf.client.schema.prompts import MAX_PROMPTS_PER_CALL, Prompt, new_claim_id

from .claims import RENEWALS_PER_CLAIM, ClaimKeeper
from .taskset import OWNER_PREFIX, POLL_SECONDS

log = logging.getLogger(__name__)
SELECTOR_NAME = "expbuf"
# The dataset settings a selector's kwargs may give, besides `path` and `dataset` (its size, epochs and seed are
# the taskset's: its rows, buffer.total_epochs, the selector's seed).
DATASET_KWARGS = frozenset(
    {"order", "order_options", "pass_threshold", "zero_variance", "skip_epochs", "max_in_flight", "max_attempts"}
)


class ExpbufSelector(BaseSelector):
    """The indices of the prompts a dataset's order hands out; feedback trains them."""

    def __init__(self, data_source: Any, config: Any) -> None:
        super().__init__(data_source, config)
        kwargs = dict(config.kwargs or {})
        path, self.dataset = kwargs.pop("path", None), kwargs.pop("dataset", None)
        if not is_expbuf_path(path) or not isinstance(self.dataset, str) or not self.dataset:
            raise ValueError(
                f"data_selector {SELECTOR_NAME}: kwargs path {path!r} and dataset {self.dataset!r}; name the table"
                " (expbuf://HOST:PORT/TABLE) and the dataset of the taskset's rows (a name)"
            )
        unknown = sorted(set(kwargs) - DATASET_KWARGS)
        if unknown:
            raise ValueError(
                f"data_selector {SELECTOR_NAME}: unknown kwargs {', '.join(unknown)}; "
                f"known: path, dataset, {', '.join(sorted(DATASET_KWARGS))}"
            )
        self.location = parse(path)
        self._client = connect(self.location)
        self._prepare(data_source, config.seed, kwargs)
        self._owner = f"{OWNER_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        keeper = connect(self.location, timeout=self.location.lease_seconds / RENEWALS_PER_CLAIM)
        self._keeper = ClaimKeeper(keeper, self.location.lease_seconds, self.location.hold_seconds)
        weakref.finalize(self, self._keeper.close)
        self._steps: deque[list[Prompt]] = deque()  # the steps handed out awaiting feedback, oldest first
        self._last: list[Prompt] | None = None  # the step handed out last
        self._total = data_source.total_samples  # the tasks Trinity's scheduler asks for over the run
        self._asked = 0  # those it asked for so far
        self._owed = 0  # the prompts released (or whose claims end) not yet handed out again
        self._stopped = False  # the dataset had no prompt left to hand out

    def _prepare(self, data_source: Any, seed: int, kwargs: dict[str, Any]) -> None:
        """The dataset, one prompt per row and an epoch per pass Trinity makes: made with the
        kwargs' settings (admin scope) when the table has none; else checked against the taskset."""
        size, table = data_source.dataset_size, self.location.table
        epochs, rest = divmod(data_source.total_samples, size)
        where = f"data_selector {SELECTOR_NAME} (dataset '{self.dataset}' of table '{table}')"
        if rest or not epochs:
            raise ValueError(f"{where}: buffer.total_steps is not a whole number of epochs; leave it unset")
        try:
            info = self._client.ledger(table, self.dataset)
        except PermissionDeniedError:
            log.warning("expbuf: this token cannot read dataset '%s' (no sample scope): not checked", self.dataset)
            return
        except NotFoundError:
            self._client.create_dataset(table, self.dataset, size, epochs=epochs, seed=seed, **kwargs)
            return
        if (info.size, info.epochs) != (size, epochs):
            raise ValueError(
                f"{where}: it has {info.size} prompts and {info.epochs} epochs, the taskset {size} rows and"
                f" {epochs} epochs: one prompt per row, and buffer.total_epochs alike"
            )
        for key in ("order", "order_options", "pass_threshold", "zero_variance", "skip_epochs"):
            have, want = getattr(info, key), kwargs.get(key, getattr(info, key))
            if key == "order_options" and isinstance(want, dict):
                have = {option: have.get(option) for option in want}  # the dataset's fills in the defaults
            if have != want:
                raise ValueError(f"{where}: it has {key} {have!r}, the kwargs {want!r}")

    def get_indices(self, batch_size: int, return_extra_info: bool = False) -> Any:
        """The indices of up to `batch_size` prompts claimed now, and of as many more as went back
        from earlier steps (the ledger hands those first), waiting for one; StopIteration once the
        dataset has none left to hand out but this explorer's own."""
        location = self.location
        self._asked += batch_size
        count = min(batch_size + self._owed, MAX_PROMPTS_PER_CALL)
        while True:  # a server that restarts is waited for (a claim whose reply was lost: answered again)
            claim = retried(
                functools.partial(
                    self._client.claim, location.table, self.dataset, count, lease_seconds=location.lease_seconds,
                    owner=self._owner, wait=POLL_SECONDS, claim_id=new_claim_id(),  # each try of it under one id
                ),
                self._client.timeout,
            )  # fmt: skip
            if claim.prompts:
                break
            if claim.done or self._only_mine_left(batch_size):
                self._stopped = True
                raise StopIteration(f"expbuf dataset '{self.dataset}': no prompt left to hand out")
        self._owed -= max(0, len(claim.prompts) - batch_size)
        self._keeper.hold(claim.prompts)
        self._last = list(claim.prompts)
        self._steps.append(self._last)
        indices = [prompt.index for prompt in claim.prompts]
        # Trinity's reader counts each task read against rows x epochs and ends the run at a step
        # that would pass it: the prompts handed out again go on top of that count.
        reader = self.data_source
        reader.total_samples = max(reader.total_samples, reader.current_offset + len(indices))
        if return_extra_info:
            return indices, {"indices": indices, "attempts": [p.attempt for p in claim.prompts]}
        return indices

    def _only_mine_left(self, batch_size: int) -> bool:
        """Whether every claim left is this explorer's and nothing else waits to go out: Trinity
        gives a step's feedback only after later reads, so this read cannot wait for them.
        Refused when the dataset's max_in_flight is full of them (nothing could make room)."""
        try:
            info = retried(lambda: self._client.ledger(self.location.table, self.dataset), self._client.timeout)
        except PermissionDeniedError:
            return False  # no sample scope: the claim's `done` ends the explorer
        claimed, mine = info.total("claimed"), len(self._keeper.held())
        if info.max_in_flight and claimed + info.total("generated") >= info.max_in_flight and claimed <= mine:
            raise ValueError(
                f"data_selector {SELECTOR_NAME}: dataset '{self.dataset}' has max_in_flight={info.max_in_flight} and"
                f" this explorer holds all {claimed} of its claims in steps awaiting feedback (Trinity gives it after"
                f" later reads): set max_in_flight to at least batch_size ({batch_size}) x (the steps in flight + 1)"
            )
        return not info.total("pending") and info.cursor_epoch >= info.epochs and claimed <= mine

    def feedback(self, indices: list[int], values: list[float]) -> None:
        """A step's feedback (each task's mean reward) reported as its prompts' outcomes, one run
        whose reward is the value: the prompts are trained, their statistics taking it. The step
        is the oldest one handed out that holds every index named (one naming none, of a step whose
        every task failed, the oldest: scheduler.py gives it); its tasks not named (no experience came
        of them) are released, to go out again, on top of a later step. A value that
        is not a finite number leaves its prompt out. The report and the release are made again
        while the server is unavailable (for the client's timeout); one that still fails is logged,
        its claims no longer renewed, ending within their lease. A prompt whose claim had ended
        (the report does not take it) goes out again, as a released one does. The last step's
        feedback ends the run: the prompts it could not hand out again are named."""
        named = {int(index): float(value) for index, value in zip(indices, values, strict=True)}
        step = next((s for s in self._steps if set(named) <= {p.index for p in s}), None)
        if step is None:
            log.warning("expbuf: feedback for tasks %s, which no step of this selector holds; left out", sorted(named))
            return
        self._steps.remove(step)
        outcomes = {p: [named[p.index]] for p in step if p.index in named and math.isfinite(named[p.index])}
        left = [p for p in step if p not in outcomes]
        unsettled = len(step)  # prompts that go out again: released, or whose claims end
        within = self._client.timeout
        try:
            if outcomes:
                taken = retried(lambda: self._client.report_prompts(outcomes), within)
                unsettled = len(left) + len(outcomes) - taken
            if left:
                retried(lambda: self._client.release_claims(left), within)
        except BufferError as exc:
            log.warning("expbuf: the outcomes of %d prompts were not reported (%s); their claims end", len(step), exc)
            self._keeper.let_go(step)
        self._owed += unsettled
        if step is self._last and (self._stopped or self._asked >= self._total):
            self._say_untrained()

    def _say_untrained(self) -> None:
        """At the run's end (Trinity's scheduler reads no more steps) the prompts still to go out
        are named: this run does not train them."""
        table, dataset = self.location.table, self.dataset
        try:
            pending = self._client.ledger(table, dataset).total("pending")
            page = self._client.list_prompts(table, dataset, states=["pending"], limit=20) if pending else None
        except BufferError:
            pending, page = self._owed, None
        if not pending:
            return
        named = ", ".join(f"{p.epoch}/{p.index}" for p in page.prompts) if page and page.prompts else "not listed"
        log.warning(
            "expbuf: dataset '%s' of table '%s': prompts not trained in this run: %d (epoch/index: %s), released"
            " (every run of their task failed) or their claims ended after Trinity's scheduler read its last step"
            " (buffer.total_epochs x rows / batch_size steps); they stay pending in the dataset",
            dataset, table, pending, named,
        )  # fmt: skip

    def state_dict(self) -> dict:
        """What the steps asked for and still owe; the dataset holds the cursor, the claims and the
        statistics, durably."""
        return {"asked": self._asked, "owed": self._owed}

    def load_state_dict(self, state_dict: dict) -> None:
        """The counts of `state_dict` (none in a state saved without them)."""
        self._asked = int(state_dict.get("asked", 0))
        self._owed = int(state_dict.get("owed", 0))
