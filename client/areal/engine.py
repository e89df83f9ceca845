"""AReaL's remote inference engine with expbuf's admission. The seam is WorkflowExecutor's own
`staleness_manager` argument, which RemoteInfEngine.initialize leaves unset.

RemoteInfEngine.initialize hands the WorkflowExecutor it builds to its `workflow_executor`
setter, then initialises it; this subclass's setter builds the same executor with an
ExpbufStalenessManager (WorkflowExecutor's public constructor), its concurrency each
data-parallel rank's share as AReaL's own manager's, and `set_version` also sets the table's
trainer version. AReaL's SGLang and vLLM engines are RemoteInfEngines with a backend:
`ExpbufRemoteInfEngine(config, SGLangBackend(), expbuf={...})` is the SGLang one.
"""

from __future__ import annotations

from typing import Any

from areal.infra.remote_inf_engine import RemoteInfEngine
from areal.infra.workflow_executor import WorkflowExecutor

from .staleness import ExpbufStalenessManager


class _Executor(WorkflowExecutor):
    """AReaL's executor over the table's staleness manager, whose concurrency is each process's
    share as AReaL's own manager's is: max_concurrent_rollouts over the data-parallel ranks (one
    engine a rank ran that many times the limit at once). The staleness bound is the table's, over
    every process: it needs no share."""

    def initialize(self, logger: Any = None, train_data_parallel_size: int | None = None) -> None:
        ranks = train_data_parallel_size if train_data_parallel_size is not None else self._resolve_dp_world_size()
        self._staleness_manager.max_concurrent_rollouts = max(1, self.max_concurrent_rollouts // ranks)
        super().initialize(logger, train_data_parallel_size)


class ExpbufRemoteInfEngine(RemoteInfEngine):
    """RemoteInfEngine(config, backend) whose staleness bound is the expbuf table's.

    `expbuf` holds ExpbufStalenessManager's arguments: client (or "HOST:PORT"), table, and
    optionally token, grant_seconds, admit_wait; the limits come from `config`
    (max_concurrent_rollouts, consumer_batch_size, max_head_offpolicyness)."""

    def __init__(self, config: Any, backend: Any, expbuf: dict[str, Any]) -> None:
        super().__init__(config, backend)
        self.expbuf_staleness = ExpbufStalenessManager(
            max_concurrent_rollouts=config.max_concurrent_rollouts or config.consumer_batch_size,
            consumer_batch_size=config.consumer_batch_size,
            max_staleness=config.max_head_offpolicyness,
            **expbuf,
        )

    @RemoteInfEngine.workflow_executor.setter
    def workflow_executor(self, executor: WorkflowExecutor) -> None:
        RemoteInfEngine.workflow_executor.fset(
            self, _Executor(executor.config, executor.inference_engine, self.expbuf_staleness)
        )

    def set_version(self, version: int) -> None:
        super().set_version(version)
        self.expbuf_staleness.set_version(version)
