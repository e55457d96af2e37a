"""Block for running a flow's tasks on SLURM: Dask workers as dask-jobqueue jobs, behind a Prefect DaskTaskRunner.

    SlurmClusterBlock(partition="gpu", cores=16, memory="200GB", max_jobs=8,
                      extra_directives=["--gpus-per-node=8"], worker_lifetime="3h50m").save("gpu-nodes")
    # then, with no code change:  --datagen.task_runner_block factory-slurm-cluster/gpu-nodes

The fields are `factory.slurm_cluster.SlurmClusterSpec`'s (one definition for
the block and the plain code); `task_runner(run_id=...)` cancels jobs an
earlier, killed run with the same run id left behind, asks `sbatch --test-only`
whether SLURM accepts the job script (a wrong partition, account or QOS fails
here, in a second), then returns the runner. The runner logs each SLURM job and
node as workers join and leave, stops the run with the worker's error when a
job dies before its worker joins, and at the end lets workers exit by
themselves (jobs end COMPLETED, not CANCELLED).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.blocks.core import Block
from prefect_dask import DaskTaskRunner

from factory.slurm_cluster import (
    JobWatch,
    SlurmClusterSpec,
    adapt_kwargs,
    cancel_jobs_named,
    check_submittable,
    cluster_kwargs,
    retire_workers,
)


class SlurmTaskRunner(DaskTaskRunner):
    """A DaskTaskRunner over a SLURMCluster whose jobs end by themselves, watching them (JobWatch) as they come and go."""

    def __init__(self, *, cluster_kwargs: dict[str, Any], adapt_kwargs: dict[str, Any], log_dir: str,
                 **kwargs: Any) -> None:
        super().__init__(cluster_class="factory.slurm_jobs.GracefulSLURMCluster", cluster_kwargs=cluster_kwargs,
                         adapt_kwargs=adapt_kwargs, **kwargs)
        self.log_dir = log_dir
        self.watch: JobWatch | None = None

    def duplicate(self) -> SlurmTaskRunner:
        return type(self)(cluster_kwargs=self.cluster_kwargs, adapt_kwargs=self.adapt_kwargs, log_dir=self.log_dir,
                          client_kwargs=self.client_kwargs, performance_report_path=self.performance_report_path)

    def submit(self, task: Any, parameters: dict[str, Any], wait_for: Any = None, dependencies: Any = None) -> Any:
        future = super().submit(task, parameters, wait_for, dependencies)
        if self.watch is None and self._cluster is not None:  # the cluster starts with the first task
            from prefect.logging import get_run_logger

            run_logger = get_run_logger()  # bound to the flow run: usable from the watch thread
            self.watch = JobWatch(self._cluster, job_name=self.cluster_kwargs["job_name"],
                                  log_dir=Path(self.log_dir), log=run_logger.info).start()
        return future

    def fault(self) -> str | None:
        """Why the run cannot go on (a worker job died on start-up), or None."""
        return self.watch.fault if self.watch is not None else None

    def __exit__(self, *args: Any) -> None:
        if self.watch is not None:
            self.watch.closing = True
        failed = bool(args and args[0] is not None) or self.fault() is not None
        if self._client is not None and self._cluster is not None:
            if failed:  # no grace for a failed run: its jobs go now, and the error reaches the user at once
                cancel_jobs_named(self.cluster_kwargs["job_name"], why="of the failed run")
            else:
                retire_workers(self._client, self._cluster, job_name=self.cluster_kwargs["job_name"])
        if self.watch is not None:
            self.watch.poll()  # the workers' leaving, in the run's log
            self.watch.stop()
        super().__exit__(*args)


class SlurmClusterBlock(Block, SlurmClusterSpec):
    """Dask workers as SLURM jobs (cores, memory, walltime, partition, prologue, adaptive job count, lifetime)."""

    _block_type_name = "Factory SLURM Cluster"

    def spec(self) -> SlurmClusterSpec:
        return SlurmClusterSpec(**{name: getattr(self, name) for name in SlurmClusterSpec.model_fields})

    def task_runner(self, run_id: str | None = None) -> SlurmTaskRunner:
        """A SlurmTaskRunner adapting between min_jobs and max_jobs jobs; raises ClusterFault if SLURM refuses them."""
        from prefect.settings import PREFECT_API_URL

        spec = self.spec()
        if spec.prefect_api_url is None and PREFECT_API_URL.value():
            spec.prefect_api_url = PREFECT_API_URL.value()  # the flow's server, also when set in a profile
        kwargs = cluster_kwargs(spec, run_id=run_id)
        cancel_jobs_named(kwargs["job_name"])
        check_submittable(kwargs)
        return SlurmTaskRunner(cluster_kwargs=kwargs, adapt_kwargs=adapt_kwargs(spec),
                               log_dir=str(Path(spec.log_dir).absolute()))
