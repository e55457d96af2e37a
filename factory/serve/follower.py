"""Find shards committed to followed runs that the service has not indexed yet, and read their index columns."""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from factory.store import ShardStore, StoreError

logger = logging.getLogger(__name__)

INDEX_COLUMNS = ["env", "env_id", "policy_version", "group_size"]


@dataclass
class NewShard:
    run_id: str
    shard: str
    path: Path
    rows: int
    index: pa.Table
    """INDEX_COLUMNS of every row."""


def read_index(path: Path) -> pa.Table:
    return pq.read_table(path, columns=INDEX_COLUMNS)


def runs_to_follow(store: ShardStore, follow: list[str], ingest_run: str) -> list[str]:
    """The ingest run first, then the configured runs ('*' = every run in the store)."""
    runs = [ingest_run]
    for run in store.runs() if "*" in follow else follow:
        if run not in runs:
            runs.append(run)
    return runs


def scan_new_shards(
    store: ShardStore, runs: list[str], known: Collection[tuple[str, str]], reported: set[str]
) -> list[NewShard]:
    """Committed, intact shards of `runs` not in `known`, in commit order; a bad shard is logged once and left out."""
    found = []
    for run_id in runs:
        shards = store.shards_dir(run_id)
        finished = False
        for name, record in store.committed(run_id).items():
            if (run_id, name) in known:
                continue
            path = shards / name
            if not finished and not path.exists():
                # Committed, not yet renamed into place: a commit in flight (wait for it) or one cut short by a
                # crash (finish it). Skipping it would let a retried post be stored a second time.
                finished = True
                try:
                    store.finish_commits(run_id)
                except (OSError, StoreError) as error:
                    logger.error("cannot finish the interrupted commits of run %s: %s", run_id, error)
            try:
                size = path.stat().st_size
                if size != record.bytes:
                    raise OSError(f"size is {size} bytes, commit log says {record.bytes}")
                index = read_index(path)
            except (OSError, pa.ArrowException) as error:
                if str(path) not in reported:
                    reported.add(str(path))
                    logger.error("shard %s left out of serving: %s", path, error)
                continue
            found.append(NewShard(run_id, name, path, index.num_rows, index))
    return found
