"""Run a flow's body inside the current flow run on another task runner: the run the user started does the work.

A datagen job picks its task runner (threads, a Dask LocalCluster, SLURM jobs) from its config, which is read
only once the flow runs. Calling the pipeline as a subflow with that runner put every task run and log line on
the subflow and counted each run twice; `tasks_on(runner)` instead starts the runner and makes it the current
run's task runner for the length of a block, so the pipeline's tasks and logs stay on the deployment's run.

    with tasks_on(make_task_runner(cfg.datagen)):
        summary = datagen_pipeline.fn(ref, config)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def in_flow_run() -> bool:
    """Whether this code runs inside a Prefect flow run."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return context is not None and context.flow_run is not None


@contextmanager
def tasks_on(runner: Any) -> Iterator[Any]:
    """Tasks submitted inside the block run on `runner` (started here, stopped after) as tasks of the current run."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None:
        raise RuntimeError("tasks_on() needs a flow run; call the flow itself outside one")
    with runner.duplicate() as started, context.model_copy(update={"task_runner": started}):
        yield started
