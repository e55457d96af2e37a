"""What the datagen flow's chunks run on: the task-runner registry.

Task runners are picked by name (`thread`, `dask`, `slurm`) or by a Prefect
block with a `task_runner()` method, so a laptop and a cluster differ in
config only.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""The checkout the flow runs from (holds environments/, tasks/, flows/, factory/)."""


def _thread(d: Any) -> Any:
    from prefect.task_runners import ThreadPoolTaskRunner

    return ThreadPoolTaskRunner(max_workers=d.thread_workers)


def _dask(d: Any) -> Any:
    import dask
    from prefect_dask import DaskTaskRunner

    # Spawned workers do not inherit the flow's sys.path: without this they import whichever copy of the project
    # is pip-installed, not the flow's code (seen: every shard write failing ScoredGroup validation).
    environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}))
    paths = [str(PROJECT_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    dask.config.set({"distributed.nanny.pre-spawn-environ": environ})
    return DaskTaskRunner(cluster_kwargs={"n_workers": d.dask_workers, "threads_per_worker": d.dask_threads_per_worker,
                                          "processes": True, "dashboard_address": None})


def _slurm(d: Any) -> Any:
    from prefect_dask import DaskTaskRunner

    if not d.slurm:
        raise ValueError("datagen.task_runner is 'slurm' but datagen.slurm is empty; give SLURMCluster arguments "
                         "(e.g. queue, cores, memory, walltime) or set datagen.task_runner_block")
    return DaskTaskRunner(cluster_class="dask_jobqueue.SLURMCluster", cluster_kwargs=dict(d.slurm),
                          adapt_kwargs={"minimum": 1, "maximum": d.slurm_jobs})


TASK_RUNNERS: dict[str, Callable[[Any], Any]] = {"thread": _thread, "dask": _dask, "slurm": _slurm}


def make_task_runner(d: Any) -> Any:
    """The task runner for `datagen` settings: a block's, else the named one from TASK_RUNNERS."""
    if d.task_runner_block:
        from prefect.blocks.core import Block

        import blocks.slurm  # noqa: F401  (Block.load finds only block classes this process has imported)

        block = Block.load(d.task_runner_block)
        if not hasattr(block, "task_runner"):
            raise ValueError(f"block {d.task_runner_block!r} has no task_runner() method; use a cluster block that does")
        if "run_id" in inspect.signature(block.task_runner).parameters:
            return block.task_runner(run_id=d.run_id)  # cluster jobs named for the run (blocks/slurm.py)
        return block.task_runner()
    return TASK_RUNNERS[d.task_runner](d)


def check_importable_by_workers(d: Any, module: str) -> None:
    """Raise PreflightError when chunks would run in other processes that cannot import the flow's module.

    Dask pickles the pipeline flow by module name. A file-path entrypoint (`flows/datagen.py:...`) loads the file
    as module `datagen`, which no Dask or SLURM worker can import: every worker would die on its first task.
    """
    if module.startswith("flows.") or (d.task_runner == "thread" and not d.task_runner_block):
        return
    from factory.preflight import PreflightError

    raise PreflightError("entrypoint", module, "the flow was loaded from a file path, so Dask/SLURM workers cannot "
                         f"import module {module!r}; deploy it by module path, e.g. entrypoint: "
                         "flows.datagen:intern_bootcamp_datagen (as in prefect.yaml)")
