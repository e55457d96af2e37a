"""Block for running a flow's tasks on SLURM: Dask workers as dask-jobqueue jobs, behind a Prefect DaskTaskRunner.

    SlurmClusterBlock(partition="gpu", cores=16, memory="200GB", max_jobs=8,
                      extra_directives=["--gpus-per-node=8"], worker_lifetime="3h50m").save("gpu-nodes")
    # then, with no code change:  --datagen.task_runner_block factory-slurm-cluster/gpu-nodes

The fields are `factory.slurm_cluster.SlurmClusterSpec`'s (one definition for
the block and the plain code); `task_runner(run_id=...)` cancels jobs an
earlier, killed run with the same run id left behind, then returns the runner.
"""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block

from factory.slurm_cluster import SlurmClusterSpec, adapt_kwargs, cancel_jobs_named, cluster_kwargs


class SlurmClusterBlock(Block, SlurmClusterSpec):
    """Dask workers as SLURM jobs (cores, memory, walltime, partition, prologue, adaptive job count, lifetime)."""

    _block_type_name = "Factory SLURM Cluster"

    def spec(self) -> SlurmClusterSpec:
        return SlurmClusterSpec(**{name: getattr(self, name) for name in SlurmClusterSpec.model_fields})

    def task_runner(self, run_id: str | None = None) -> Any:
        """A DaskTaskRunner over `dask_jobqueue.SLURMCluster`, adapting between min_jobs and max_jobs jobs."""
        from prefect_dask import DaskTaskRunner

        from prefect.settings import PREFECT_API_URL

        spec = self.spec()
        if spec.prefect_api_url is None and PREFECT_API_URL.value():
            spec.prefect_api_url = PREFECT_API_URL.value()  # the flow's server, also when set in a profile
        kwargs = cluster_kwargs(spec, run_id=run_id)
        cancel_jobs_named(kwargs["job_name"])
        return DaskTaskRunner(cluster_class="dask_jobqueue.SLURMCluster", cluster_kwargs=kwargs,
                              adapt_kwargs=adapt_kwargs(spec))
