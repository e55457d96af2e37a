"""What the datagen flow runs on and when it waits: the task-runner registry and serve-mode backpressure.

Task runners are picked by name (`thread`, `dask`, `slurm`) or by a Prefect
block with a `task_runner()` method, so a laptop and a cluster differ in
config only. Backpressure follows Atropos's `max_batches_offpolicy`: before
each chunk, pause while the batching API's queue (GET /status `queue_size`, in
groups), plus the flow's groups in flight or not yet indexed, times group_size
reaches `max_batches_offpolicy` x batch_size (batch_size from GET /info unless
configured).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
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


def use_endpoints_block(cfg: Any) -> None:
    """Point `cfg.openai` at the endpoints of the block named in `datagen.endpoints_block`, keeping its other settings.

    The sglang-on-slurm flow saves its servers (or router) as such a block, so a datagen deployment samples
    from whatever that flow started without a parameter change.
    """
    name = cfg.datagen.endpoints_block
    if not name:
        return
    from blocks.inference import InferenceEndpointsBlock

    block = InferenceEndpointsBlock.load(name)
    update = {"base_url": block.base_urls, "server_type": block.server_type, "api_key": block.api_key.get_secret_value(),
              "num_max_requests_at_once": block.num_max_requests_at_once}
    if block.model_name != "default":
        update["model_name"] = block.model_name
    cfg.openai = type(cfg.openai).model_validate({**cfg.openai.model_dump(), **update})
    logger.info("sampling from the endpoints of block %r: %s", name, cfg.openai.base_url)


class Backpressure:
    """Asks the batching API how far the trainer is behind and waits until it catches up.

    Like Atropos's env, the flow counts its own work the queue does not show yet: items in chunks still in
    flight, and groups it committed that the API has not indexed (it follows the store every
    `follow_interval_s`). Indexed groups are read from our API's /status (queue_size + served_groups +
    skipped); against an API without those keys only the in-flight items are added.
    """

    def __init__(self, serve: Any, group_size: int, *, timeout: float = 10.0) -> None:
        self.api_url = serve.api_url.rstrip("/")
        self.max_batches = serve.max_batches_offpolicy
        self.batch_size = serve.batch_size
        self.poll_s = serve.poll_s
        self.group_size = group_size
        self.http = httpx.Client(timeout=timeout)
        self.committed = 0
        """Groups this flow committed since it started."""
        self._indexed_base: int | None = None
        self._indexed_last = 0

    def _get(self, path: str) -> dict[str, Any]:
        response = self.http.get(f"{self.api_url}{path}")
        response.raise_for_status()
        return response.json()

    def limit(self) -> int | None:
        """Sequences the queue may hold before the flow pauses; None while the trainer has not registered."""
        if self.batch_size <= 0:
            batch_size = int(self._get("/info").get("batch_size", -1))
            if batch_size <= 0:
                return None
            self.batch_size = batch_size
        return self.max_batches * self.batch_size

    def unseen(self, status: dict[str, Any]) -> int:
        """Groups this flow committed that the API has not indexed yet (0 if its /status cannot tell)."""
        if "served_groups" not in status:
            return 0
        indexed = sum(int(status.get(key, 0)) for key in ("queue_size", "served_groups", "skipped_stale", "skipped_oversize"))
        if self._indexed_base is None:
            self._indexed_base = indexed - self.committed
        elif indexed < self._indexed_last:  # /reset_data started a new epoch of served counts
            self._indexed_base -= self._indexed_last - indexed
        self._indexed_last = indexed
        return max(0, self.committed - (indexed - self._indexed_base))

    def behind(self, in_flight_items: int = 0) -> bool:
        if self.max_batches <= 0:
            return False
        limit = self.limit()
        if limit is None:
            return True  # Atropos waits for the trainer to register before producing
        status = self._get("/status")
        pending = int(status.get("queue_size", 0)) + self.unseen(status) + in_flight_items
        return pending * self.group_size >= limit

    def would_wait(self, in_flight_items: int) -> bool:
        """Whether the next chunk has to wait (also when the API does not answer)."""
        try:
            return self.behind(in_flight_items)
        except (httpx.HTTPError, ValueError):
            return True

    def wait(self, log: Any = logger) -> float:
        """Block while the trainer is behind; returns the seconds paused. API outages are retried, not fatal."""
        started = time.monotonic()
        announced = False
        while True:
            try:
                if not self.behind():
                    break
            except (httpx.HTTPError, ValueError) as error:
                log.warning("batching API %s not answering (%s); retrying in %.1fs", self.api_url, error, self.poll_s)
            if not announced:
                log.info("paused: the trainer is %d+ batches behind (or not registered); waiting", self.max_batches)
                announced = True
            time.sleep(self.poll_s)
        paused = time.monotonic() - started
        if announced:
            log.info("resumed after %.1fs", paused)
        return paused
