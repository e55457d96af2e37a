"""Prefect task that commits a chunk of groups as one shard (a thin wrapper over the store's `commit`: a local or
shared `ShardStore`, or an `ObjectShardStore` for an s3:// root)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

from environments.groups import ScoredGroup
from factory.run_logging import logs_to_task_run
from factory.store import CommitRecord
from factory.store_object import open_store


def write_shard(root: str, run_id: str, producer: str, chunk: int, groups: Sequence[ScoredGroup]) -> CommitRecord:
    """Commit `groups` as the shard of (run, producer, chunk); a committed chunk is skipped."""
    return open_store(root).commit(run_id, producer, chunk, groups)


def write_shard_retrying(root: str, run_id: str, producer: str, chunk: int, groups: Sequence[ScoredGroup], *,
                         delays_s: Sequence[float] = (1.0, 5.0), sleep: Callable[[float], None] = time.sleep,
                         logger: logging.Logger | logging.LoggerAdapter | None = None) -> CommitRecord:
    """`write_shard`, retried after each of `delays_s` when it raises, each retry logged as a warning.

    The datagen flow commits in its own process with this instead of a task run per chunk (the same retries as
    `write_shard_task`, without its Prefect engine and server cost); a retry is safe because a committed chunk
    is skipped.
    """
    for attempt, delay in enumerate(delays_s, start=1):
        try:
            return write_shard(root, run_id, producer, chunk, groups)
        except Exception as error:
            (logger or logging.getLogger(__name__)).warning(
                "chunk %d: shard commit failed (%s: %s); retry %d of %d in %gs", chunk, type(error).__name__, error,
                attempt, len(delays_s), delay)
            sleep(delay)
    return write_shard(root, run_id, producer, chunk, groups)  # the last try: its error is the run's


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
