"""A Trinity-RFT explorer's loop over a taskset read from an expbuf dataset, run as a child process
so that the crash test can kill it with SIGKILL.

usage: trinity_explorer_child.py CONFIG LOG [DIE_AT]

The loop is Trinity's Explorer.explore_step with Trinity's own parts: the job's config loaded and
checked by Trinity (`load_config`, `check_and_update`), the explorer's checkpoint (StateManager),
its taskset (`get_taskset_scheduler`, which asks `get_buffer_reader`: the plugin's ExpbufTaskset),
each task's workflow (`Task.to_workflow`), and the experience pipeline that writes a step's
experiences through the plugin's writer, as the rollout coordinator does. The rollout of a task
is what Trinity's WorkflowRunner.run_task does (its module needs vLLM, which a CPU machine lacks):
the workflow's runs, each experience's eid batch the explore step and task its place in the step,
`info["task_index"]` the task's index. As Trinity's explorer (fully async), a step is written
only when `explorer.max_inflight_batches` steps are in flight at a read, and at the end, after
the read that stops the loop: the explorer holds the claims of its unwritten steps meanwhile.
Each read is a `read STEP BATCH/TASK ...` line in LOG and each write a `wrote STEP` line,
fsynced. At step DIE_AT the explorer writes `ready` after its read (and the write it made room
with) and waits to be killed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from collections import deque
from collections.abc import Callable

import torch


def import_frameworks() -> None:
    """Trinity-RFT's modules and the user's workflow registered, by main() here and by the test
    modules that import this one (their import_frameworks): not at the import, which every pytest
    worker does for those modules."""
    global create_operators, ExperiencePipeline, Config, load_config, EID, Experience, WORKFLOWS, Task, Workflow
    global StateManager, load_plugins, AnswerWorkflow
    from trinity.buffer.operators.experience_operator import create_operators
    from trinity.buffer.pipelines.experience_pipeline import ExperiencePipeline
    from trinity.common.config import Config, load_config
    from trinity.common.experience import EID, Experience
    from trinity.common.workflows import WORKFLOWS, Task, Workflow
    from trinity.manager.state_manager import StateManager
    from trinity.utils.plugin_loader import load_plugins

    class AnswerWorkflow(Workflow):
        """A user's workflow: each run answers the task's row (its `answer` in the last token), its
        reward the run's number, so a group's runs differ and its advantages are not all zero."""

        can_repeat = True

        def set_repeat_times(self, repeat_times: int, run_id_base: int) -> None:
            self.repeat_times, self.run_id_base = repeat_times, run_id_base

        def run(self) -> list[Experience]:
            answer = int(self.task.raw_task["answer"])
            return [
                Experience(
                    eid=EID(run=self.run_id_base + run),
                    tokens=torch.tensor([1, 2, 3, 4 + answer], dtype=torch.int32),
                    prompt_length=3,
                    logprobs=torch.full((1,), -0.5),
                    reward=float(run),
                    info={},
                )
                for run in range(self.repeat_times)
            ]

    if WORKFLOW not in WORKFLOWS.modules:
        WORKFLOWS.register_module(WORKFLOW, AnswerWorkflow)


WORKFLOW = "expbuf_answer"


def rollout(task: Task, repeat_times: int) -> bytes:
    """What Trinity's WorkflowRunner.run_task makes of a task: its runs, their eids and infos."""
    workflow = task.to_workflow(model=None)
    workflow.set_repeat_times(repeat_times, 0)
    experiences = workflow.run()
    for exp in experiences:
        exp.eid.batch = task.batch_id
        if exp.eid.task == "":
            exp.eid.task = task.task_id
        exp.info.update(model_version=0, model_version_drift=0, use_count=0, task_index=task.index)
    return Experience.serialize_many(experiences)


async def explore(config: Config, note: Callable[[str], None], die_at: int | None = None) -> int:
    """Trinity's explore loop until its taskset ends (StopAsyncIteration); returns the last step."""
    from trinity.buffer.task_scheduler import get_taskset_scheduler  # after the plugin's install

    state = StateManager(path=config.checkpoint_job_dir, explorer_name=config.explorer.name, config=config)
    explorer_state = state.load_explorer()
    step = explorer_state.get("latest_iteration", 0)
    taskset = get_taskset_scheduler(explorer_state=explorer_state, config=config)
    pipeline = ExperiencePipeline(config)  # its writer: the plugin's, for the expbuf:// path
    await pipeline.output.acquire()
    pipeline.operators = create_operators(config.data_processor.experience_pipeline.operators, {})
    pipeline._set_algorithm_operators(config.algorithm)
    inflight: deque[tuple[int, list[bytes]]] = deque()  # steps read and rolled out, not yet written

    async def finish_oldest() -> None:
        written, payloads = inflight.popleft()
        await pipeline.process_serialized_chunks(payloads)
        state.save_explorer(current_step=written, taskset_states=taskset.state_dict())
        note(f"wrote {written}")

    while True:
        try:
            tasks = await taskset.read()
        except StopAsyncIteration:
            break
        step += 1
        prompts = [f"{task.index['expbuf']['batch']}/{task.index['expbuf']['task']}" for task in tasks]
        note(f"read {step} {' '.join(prompts)}")
        if len(inflight) >= config.explorer.max_inflight_batches:
            await finish_oldest()
        if step == die_at:
            note("ready")
            await asyncio.sleep(600)
        scheduled = [dataclasses.replace(task, batch_id=step, task_id=i) for i, task in enumerate(tasks)]
        inflight.append((step, [rollout(task, config.algorithm.repeat_times) for task in scheduled]))
    while inflight:  # Trinity's finish_current_steps
        await finish_oldest()
    await pipeline.close()
    note("done")
    return step


def main() -> None:
    config_path, log_path, *die = sys.argv[1:]
    import_frameworks()
    load_plugins()  # TRINITY_PLUGIN_DIRS: expbuf's plugin
    config = load_config(config_path)
    config.check_and_update()
    with open(log_path, "a") as log:

        def note(line: str) -> None:
            log.write(line + "\n")
            log.flush()
            os.fsync(log.fileno())

        asyncio.run(explore(config, note, int(die[0]) if die else None))


if __name__ == "__main__":
    main()
