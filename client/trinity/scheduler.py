"""Each explore step's feedback reaches the expbuf selectors its read drew from, even a step none
of whose tasks made an experience.

Trinity's TasksetScheduler hands a step's feedback only to the tasksets its experience pipeline
names (its pass_rate_calculator names a taskset by its experiences), so a step whose every run
failed, or that was aborted, called no selector: an expbuf selector kept the step's prompts
claimed until `hold_seconds` and did not count them as owed, so one prompt a task went untrained
at the run's end, unnamed. The explorer gives each step's feedback once, oldest step first, so the
scheduler's read and feedback are wrapped: a read records the tasksets it drew from, and a step's
feedback gives each expbuf selector among them that it does not name a feedback naming no task.

A job of one expbuf:// taskset (ExpbufTaskset) gets Trinity's SimpleTasksetScheduler, whose
feedback does nothing: it is wrapped too, so that a step's feedback tells the taskset its step is
written, and the taskset releases the claims of the step's tasks that made no complete group.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from trinity.buffer.task_scheduler import SimpleTasksetScheduler, TasksetScheduler
from trinity.common.constants import SELECTOR_METRIC

from .selector import ExpbufSelector
from .taskset import ExpbufTaskset

_STEPS = "_expbuf_steps"  # the scheduler's attribute: the tasksets each step awaiting feedback read


def _steps(scheduler: TasksetScheduler) -> deque[set[int]]:
    steps = vars(scheduler).get(_STEPS)
    if steps is None:
        steps = vars(scheduler)[_STEPS] = deque()
    return steps


def _read(original: Callable[[TasksetScheduler], Awaitable[list]]) -> Callable[[TasksetScheduler], Awaitable[list]]:
    async def read(self: TasksetScheduler) -> list:
        batch = await original(self)
        _steps(self).append({task.index["taskset_id"] for task in batch})
        return batch

    return read


def _feedback(original: Callable[[TasksetScheduler, dict], None]) -> Callable[[TasksetScheduler, dict], None]:
    def feedback(self: TasksetScheduler, pipeline_metrics: dict) -> None:
        named = set(pipeline_metrics.get(SELECTOR_METRIC) or {})
        steps = _steps(self)
        read = steps.popleft() if steps else set()
        original(self, pipeline_metrics)
        for taskset_id in sorted(read - named):
            selector = getattr(getattr(self.tasksets[taskset_id], "reader", None), "selector", None)
            if isinstance(selector, ExpbufSelector):
                selector.feedback([], [])

    return feedback


Feedback = Callable[[SimpleTasksetScheduler, dict], None]


def _written(original: Feedback) -> Feedback:
    def feedback(self: SimpleTasksetScheduler, pipeline_metrics: dict) -> None:
        original(self, pipeline_metrics)
        reader = getattr(self, "reader", None)
        if isinstance(reader, ExpbufTaskset):
            reader.step_written()

    return feedback


def install() -> None:
    """Wrap TasksetScheduler's read and feedback, and SimpleTasksetScheduler's feedback (once)."""
    cls: Any = TasksetScheduler
    if not hasattr(cls.feedback, "__expbuf_original__"):
        read, feedback = _read(cls.read), _feedback(cls.feedback)
        read.__expbuf_original__, feedback.__expbuf_original__ = cls.read, cls.feedback  # type: ignore[attr-defined]
        cls.read, cls.feedback = read, feedback
    simple: Any = SimpleTasksetScheduler
    if not hasattr(simple.feedback, "__expbuf_original__"):
        written = _written(simple.feedback)
        written.__expbuf_original__ = simple.feedback  # type: ignore[attr-defined]
        simple.feedback = written
