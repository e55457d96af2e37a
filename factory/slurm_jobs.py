"""dask-jobqueue's SLURMCluster with worker jobs that end by themselves, so `CANCELLED` in a job's log means a fault.

When the adaptive cluster scales down, Dask first retires the worker (it hands
its results over and exits) and then dask-jobqueue runs `scancel` on its job at
once, while the worker is still exiting; SLURM then writes `*** JOB N CANCELLED
***` to `slurm-<id>.out` for a job that did nothing wrong. `GracefulSLURMJob`
gives a running job `JOB_EXIT_GRACE_S` to end by itself before cancelling it
(a pending job is cancelled at once: it has no log).
"""

from __future__ import annotations

import asyncio

from dask_jobqueue import SLURMCluster
from dask_jobqueue.slurm import SLURMJob

JOB_EXIT_GRACE_S = 15.0
"""Seconds a running job whose worker was retired gets to end on its own before scancel."""


async def job_state(job_id: str) -> str | None:
    """The job's SLURM state (RUNNING, PENDING, ...), or None once squeue no longer lists it."""
    process = await asyncio.create_subprocess_exec("squeue", "-h", "-j", job_id, "-o", "%T",
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    out, _ = await process.communicate()
    return out.decode().strip() or None if process.returncode == 0 else None


class GracefulSLURMJob(SLURMJob):
    """A worker job that is cancelled only if it does not end by itself within JOB_EXIT_GRACE_S."""

    async def close(self) -> None:
        if self.job_id:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + JOB_EXIT_GRACE_S
            while loop.time() < deadline and await job_state(self.job_id) in ("RUNNING", "COMPLETING"):
                await self._retire_own_workers()  # a worker that joined after it was scaled away is still there
                await asyncio.sleep(1.0)
        await super().close()  # scancel; a job that is gone already is skipped quietly

    async def _retire_own_workers(self) -> None:
        from distributed.core import rpc

        names = [self.name] + [f"{self.name}-{i}" for i in range(self.worker_processes)]
        try:
            async with rpc(self.scheduler) as scheduler:
                await scheduler.retire_workers(names=names, close_workers=True, remove=True)
        except Exception:  # noqa: BLE001 - the scancel after the grace period ends it anyway
            pass


class GracefulSLURMCluster(SLURMCluster):
    """SLURMCluster whose jobs are GracefulSLURMJob."""

    job_cls = GracefulSLURMJob
