"""Trinity-RFT's data selector `expbuf`: a file taskset's tasks chosen by an expbuf dataset's
claim order, so that a curriculum survives restarts.

Trinity's own `difficulty_based` selector keeps its Beta posteriors in memory (its state_dict is
its position alone) and starts over after a restart. This one claims each step's prompts from a
dataset of the prompt ledger, whose order (`pools`, `pass_rate`, or the permutation) reads each
prompt's durable statistics, and reports the feedback Trinity's experience pipeline gives (each
task's mean reward, the `pass_rate_calculator` operator's) as the prompt's outcome, which trains
it and updates its statistics in the same transaction. Trinity's TasksetScheduler drives it; the
dataset keeps every state, so `state_dict` is empty. The claims are renewed while the explorer
lives and end when it dies, their prompts going out again.

```yaml
buffer:
  explorer_input:
    taskset:
      path: /data/math
      data_selector:
        selector_type: expbuf
        kwargs: {path: "expbuf://10.0.0.5:50051/grpo8", dataset: math, order: pass_rate}
```
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
import weakref
from typing import Any

from trinity.buffer.selector.selector import BaseSelector

from expbuf.client.kit.location import connect, is_expbuf_path, parse
from expbuf.client.schema.prompts import Prompt

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
        size = data_source.dataset_size
        self._client.create_dataset(
            self.location.table,
            self.dataset,
            size,
            epochs=max(1, data_source.total_samples // size),
            seed=config.seed,
            exist_ok=True,  # the same settings after a restart; other ones are refused by name
            **kwargs,
        )
        self._owner = f"{OWNER_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        keeper = connect(self.location, timeout=self.location.lease_seconds / RENEWALS_PER_CLAIM)
        self._keeper = ClaimKeeper(keeper, self.location.lease_seconds, self.location.hold_seconds)
        weakref.finalize(self, self._keeper.close)
        self._handed: dict[int, list[Prompt]] = {}  # by index, the prompts awaiting feedback, oldest first

    def get_indices(self, batch_size: int, return_extra_info: bool = False) -> Any:
        """The indices of up to `batch_size` prompts claimed now, waiting for one; StopIteration
        once the dataset has none left to hand out but this explorer's own."""
        location = self.location
        while True:
            claim = self._client.claim(
                location.table, self.dataset, batch_size, lease_seconds=location.lease_seconds,
                owner=self._owner, wait=POLL_SECONDS,
            )  # fmt: skip
            if claim.prompts:
                break
            if claim.done or self._only_mine_left():
                raise StopIteration(f"expbuf dataset '{self.dataset}': no prompt left to hand out")
        self._keeper.hold(claim.prompts)
        for prompt in claim.prompts:
            self._handed.setdefault(prompt.index, []).append(prompt)
        indices = [prompt.index for prompt in claim.prompts]
        if return_extra_info:
            return indices, {"indices": indices, "attempts": [p.attempt for p in claim.prompts]}
        return indices

    def _only_mine_left(self) -> bool:
        info = self._client.ledger(self.location.table, self.dataset)
        mine = len(self._keeper.held())
        return not info.total("pending") and info.cursor_epoch >= info.epochs and info.total("claimed") <= mine

    def feedback(self, indices: list[int], values: list[float]) -> None:
        """Each task's feedback (its runs' mean reward) reported as its prompt's outcome: the
        prompt is trained, its statistics taking the value as one run's reward."""
        outcomes: dict[Prompt, list[float]] = {}
        for index, value in zip(indices, values, strict=True):
            waiting = self._handed.get(int(index))
            if not waiting:
                log.warning("expbuf: feedback for task %s, which this selector did not hand out; left out", index)
                continue
            outcomes[waiting.pop(0)] = [float(value)]
        if outcomes:
            self._client.report_prompts(outcomes)

    def state_dict(self) -> dict:
        """Nothing: the dataset holds the cursor, the claims and the statistics, durably."""
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        """Nothing to restore (`state_dict`)."""
