"""Prefect task that commits a chunk of groups as one shard (a thin wrapper over the store's `commit`: a local or
shared `ShardStore`, or an `ObjectShardStore` for an s3:// root)."""

from __future__ import annotations

from collections.abc import Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

from environments.groups import ScoredGroup
from factory.run_logging import logs_to_task_run
from factory.store import CommitRecord
from factory.store_object import open_store


def write_shard(root: str, run_id: str, producer: str, chunk: int, groups: Sequence[ScoredGroup]) -> CommitRecord:
    """Commit `groups` as the shard of (run, producer, chunk); a committed chunk is skipped."""
    return open_store(root).commit(run_id, producer, chunk, groups)


write_shard_task = task(
    logs_to_task_run(write_shard),
    name="write-shard",
    task_run_name="write-shard-{producer}-{chunk}",
    retries=2,
    retry_delay_seconds=[1, 5],
    # Prefect's default cache policy hashes the task's inputs: it cloudpickled every chunk's groups (~20-30 us of
    # CPU per group) for a cache key nothing reads; a committed chunk is skipped by the store itself.
    cache_policy=NO_CACHE,
)
