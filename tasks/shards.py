"""Prefect task that commits a chunk of groups as one shard (a thin wrapper over the store's `commit`: a local or
shared `ShardStore`, or an `ObjectShardStore` for an s3:// root)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from environments.groups import ScoredGroup
from factory.run_logging import logs_to_task_run
from factory.store import CommitRecord, ShardStore
from factory.store_object import open_store

_STORES_KEPT = 8
_stores: OrderedDict[str, ShardStore] = OrderedDict()
_stores_lock = threading.Lock()


def store_at(root: str) -> Any:
    """The store at `root`; a local or shared one is opened once per process and kept (the 8 latest roots).

    A `ShardStore` keeps what it has read of a run's commit log and has finished its interrupted commits once; a
    new one per commit loaded the manifest, parsed the log after it and listed the shards directory every time:
    +3 ms of CPU per commit at 100 committed chunks, +15 ms at 1000-3000 (bench/RESULTS.md, issue 33). Commits of
    one run stay serialized across threads and processes by the store's own file lock."""
    key = str(root)
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = open_store(root)
            if not isinstance(store, ShardStore):
                return store  # an object store: opened per commit, as before
            _stores[key] = store
            while len(_stores) > _STORES_KEPT:
                _stores.popitem(last=False)
        else:
            _stores.move_to_end(key)
        return store


def write_shard(root: str, run_id: str, producer: str, chunk: int, groups: Sequence[ScoredGroup]) -> CommitRecord:
    """Commit `groups` as the shard of (run, producer, chunk); a committed chunk is skipped."""
    return store_at(root).commit(run_id, producer, chunk, groups)


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
