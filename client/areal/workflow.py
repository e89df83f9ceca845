"""ExpbufWorkflow: any AReaL workflow, whose trajectories also go to an expbuf table as whole groups.

AReaL takes it as the workflow (an object, or its import path with `workflow_kwargs`), so
nothing in AReaL changes. One episode (one prompt) is one group, its `task`; each row of what
the wrapped workflow returns is a `run`; an agent's interactions are the `step`s of their run,
in the order the workflow returned them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from areal.api.workflow_api import RolloutWorkflow
from areal.experimental.openai.types import InteractionWithTokenLogpReward
from areal.utils.data import concat_padded_tensors
from areal.utils.dynamic_import import import_from_string

from ..client import BufferClient, BufferError
from ..kit.retry import retried
from ..kit.tables import connect, table_info
from ..schema.experience import EID, Experience, ordered_id
from ..schema.routing import GROUP_KEY_OF
from .convert import from_areal
from .staleness import PRODUCED

log = logging.getLogger(__name__)


def resolve_workflow(workflow: Any, workflow_kwargs: dict[str, Any] | None) -> RolloutWorkflow:
    """A RolloutWorkflow from an object, a class or an import path, as AReaL's engine resolves them."""
    if isinstance(workflow, str):
        workflow = import_from_string(workflow)
    if isinstance(workflow, type) and issubclass(workflow, RolloutWorkflow):
        workflow = workflow(**(workflow_kwargs or {}))
    if not isinstance(workflow, RolloutWorkflow):
        raise TypeError(f"workflow must be a RolloutWorkflow, its class or its import path, got {workflow!r}")
    return workflow


def _is_interactions(result: dict[str, Any]) -> bool:
    return bool(result) and all(isinstance(v, InteractionWithTokenLogpReward) for v in result.values())


class ExpbufWorkflow(RolloutWorkflow):
    """Runs `workflow` `group_size` times per prompt (AReaL's grouping; leave AReaL's own
    group_size at 1), pushes the group to `table`, and returns what AReaL would get from the
    workflow itself: its trajectory unchanged (group_size 1), or the group's rows concatenated
    as AReaL's GroupedRolloutWorkflow does. With `produce_only`, it returns None: AReaL only
    produces rollouts for a trainer that samples the table, and trains on nothing itself; an
    ExpbufStalenessManager of its process counts each group it pushed as accepted (staleness.PRODUCED).

    A push that fails raises, so AReaL's executor counts the rollout as rejected; experiences
    dropped as stale by the table are logged. Runs the workflow rejected (returned None) are
    reported failed (`fail_runs`) where the table sets `min_group_size` and each run is one row:
    the table then completes the group short, or drops it when too few succeeded. Otherwise a
    group left short of the table's `group_size` by a rejected run, or an agent's variable number
    of turns, is sealed after its push; a whole group
    of rows that is short is refused (AReaL's own grouping left above 1 would make groups of one,
    with nothing to compare within them).
    """

    def __init__(
        self,
        workflow: Any,
        client: BufferClient | str,
        table: str,
        *,
        workflow_kwargs: dict[str, Any] | None = None,
        group_size: int = 1,
        produce_only: bool = False,
        batch: str = "areal",
        token: str | None = None,
    ) -> None:
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        self.workflow = resolve_workflow(workflow, workflow_kwargs)
        self.client = connect(client, token)
        self.table = table
        self.group_size = group_size
        self.produce_only = produce_only
        self.batch = batch
        config = table_info(self.client, table)
        self._group_key = None if config.group_by == "none" else GROUP_KEY_OF[config.group_by]
        self._table_group_size = config.group_size
        self._min_group_size = config.min_group_size

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        results = await asyncio.gather(*[self.workflow.arun_episode(engine, data) for _ in range(self.group_size)])
        valid = [r for r in results if r is not None]
        if valid:
            exps = self._experiences(valid, ordered_id())  # the table's keys in push order
            whole = len(valid) == self.group_size and not _is_interactions(valid[0])
            if whole and len(exps) < self._table_group_size:
                raise ValueError(
                    f"a whole group of {len(exps)} experiences (group_size {self.group_size}) is short of table "
                    f"'{self.table}''s group_size {self._table_group_size}: give ExpbufWorkflow the group size and "
                    "leave AReaL's own at 1 (gconfig.n_samples), or it would push groups of one; nothing was pushed"
                )
            task = exps[0].eid.task if exps else ""
            failed = []
            if self._min_group_size and not _is_interactions(valid[0]) and len(exps) == len(valid):
                failed = [EID(batch=self.batch, task=task, run=run).uid for run in range(len(valid), self.group_size)]
            await asyncio.to_thread(self._push, exps, failed)
            if self.produce_only:  # AReaL hears None, a rejection: the group counts under the table's bound
                PRODUCED.add(self.table)
        if self.produce_only or not valid:
            return None
        if self.group_size == 1:
            return valid[0]
        if _is_interactions(valid[0]):
            return {k: v for r in valid for k, v in r.items()}
        return concat_padded_tensors(valid)

    def _experiences(self, results: list[dict[str, Any]], task: str) -> list[Experience]:
        exps: list[Experience] = []
        run = 0
        for result in results:
            if _is_interactions(result):
                if not all(v.has_tensor_data for v in result.values()):
                    raise ValueError("interactions without token data (an external API's) cannot go to expbuf")
                rows = [v.to_tensor_dict() for v in result.values()]
                exps += [
                    exp
                    for step, row in enumerate(rows)
                    for exp in from_areal(row, [EID(batch=self.batch, task=task, run=run, step=step)])
                ]
                run += 1
            else:
                count = result["input_ids"].shape[0]
                exps += from_areal(result, [EID(batch=self.batch, task=task, run=run + i) for i in range(count)])
                run += count
        return exps

    def _push(self, exps: list[Experience], failed: list[str]) -> None:
        """Push a group's runs; report its rejected runs failed (`failed`), or seal it short."""
        # a server that restarts is waited for: the same uids, pushed again, are stored once
        result = retried(lambda: self.client.push(exps, table=self.table), self.client.timeout)
        if result.stale:
            log.warning("expbuf table '%s' dropped %d stale experiences of this group", self.table, len(result.stale))
        if failed:  # made again while the server restarts, as the push: a run reported again is not counted
            self._settled(
                lambda: self.client.fail_runs(failed, self.table, reasons=["rejected by the workflow"] * len(failed))
            )
            return
        if self._group_key is None or not result.stored:
            return
        stored = set(result.stored)
        for group in sorted({getattr(e.eid, self._group_key) for e in exps if e.eid.uid in stored}):
            if group not in result.completed_groups:
                self._seal(group)

    def _seal(self, group: str) -> None:
        self._settled(lambda: self.client.seal(group, self.table))

    def _settled(self, settle: Callable[[], object]) -> None:
        """A group's runs reported failed, or the group sealed, made again while the server is
        unavailable (a restart), as the push before it: left undone, the group stayed pending for
        good (no group timeout by default), its runs never trained. A group completed meanwhile (a
        call made again, or a retried push) has nothing left to settle."""
        try:
            retried(settle, self.client.timeout)
        except BufferError as exc:
            if exc.code.name != "FAILED_PRECONDITION":
                raise
