"""Compaction on an object store: merge a run's committed shard objects into larger ones, recorded by one object.

The object-store counterpart of factory/store_compact.py (same plan, same report, same member order and row
numbers, so everything keyed by (run, shard, row), such as run-api's served state, stays right). Objects cannot be
renamed or appended to, so the steps are PUTs and DELETEs, each safe to be killed after:

1. the members are read, checked against their records (size and sha256) and merged, in commit order, into one
   Parquet object PUT under its final, unique name `shards/compact-<first member>-<random>.parquet`. No record
   names it yet, so no reader reads it (a kill here leaves an unreferenced object);
2. the compaction record `compactions/<name>.json` is PUT: `{"compact": name, "members": [member records],
   "rows", "bytes", "sha256", "committed_at"}`. This PUT is the commit point: from here on readers take the
   members' rows from the merged object (rows `offset .. offset + rows`, in member order);
3. the members' commit records are deleted (listings then stay short: readers list `commits/` before
   `compactions/`, so every shard is found through one of the two, and a shard found through both is read once,
   from the merged object);
4. the member shard objects are deleted once the compaction record is `keep_members_s` old (default one hour, at a
   later compaction of the run), so a reader that listed the run before step 2 can still read them meanwhile.

A kill at any point leaves every committed group readable exactly once; the next compaction of the run finishes
steps 3 and 4 of earlier ones. One compactor per run at a time (two racing ones waste work: the first record wins).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from factory.schema import GROUP_SCHEMA
from factory.store import PARQUET_OPTIONS, CommitRecord, ShardStore, StoreError
from factory.store_compact import DEFAULT_TARGET_BYTES, CompactReport, compact_run, plan
from factory.store_object import ObjectShardStore

logger = logging.getLogger(__name__)

GET_THREADS = 8
"""Member objects fetched at once while a batch is merged (see `_members`)."""
GET_AHEAD = 32
"""Member GETs requested ahead of the member being merged."""
KEEP_MEMBERS_S = 3600.0
"""Seconds the member shard objects of a compaction are kept after its record (for readers that listed before)."""


def _reached(point: str) -> None:
    """A named step of a compaction; the kill tests replace this to die exactly here."""


def compact_object_run(
    store: ObjectShardStore,
    run_id: str,
    *,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    flush: bool = True,
    row_group_groups: int = 256,
    keep_members_s: float = KEEP_MEMBERS_S,
) -> CompactReport:
    """Merge the run's shards into objects of about `target_bytes` (see the module docstring)."""
    report = CompactReport(run_id)
    start = time.perf_counter()
    committed = store.committed(run_id)
    if not committed:
        raise StoreError(f"run {run_id} has no commit records in store {store.url}; runs there: {store.runs() or 'none'}")
    finish_compactions(store, run_id, keep_members_s)
    for batch in plan(list(committed.values()), target_bytes, flush=flush):
        _merge(store, run_id, batch, row_group_groups, report)
    if report.files:
        finish_compactions(store, run_id, keep_members_s)
    report.seconds = time.perf_counter() - start
    return report


def _get(store: ObjectShardStore, path: str) -> bytes:
    with store.fs.open_input_stream(path) as handle:
        return handle.read()


def _members(store: ObjectShardStore, run_id: str, batch: list[CommitRecord],
             pool: ThreadPoolExecutor) -> Iterator[tuple[CommitRecord, str, Future[bytes]]]:
    """The batch's members in order, each with its GET, up to `GET_AHEAD` of them requested ahead of the one
    being merged: a GET mostly waits for the store (one request per member made the compaction request-bound)."""
    paths = [store.shard_path(run_id, record.shard) for record in batch]
    gets = [pool.submit(_get, store, path) for path in paths[:GET_AHEAD]]
    for index, record in enumerate(batch):
        if index + GET_AHEAD < len(batch):
            gets.append(pool.submit(_get, store, paths[index + GET_AHEAD]))
        yield record, paths[index], gets[index]


def _merge(store: ObjectShardStore, run_id: str, batch: list[CommitRecord], row_group_groups: int,
           report: CompactReport) -> None:
    pool = ThreadPoolExecutor(GET_THREADS, thread_name_prefix="compact-get")
    try:
        merged = _read_members(store, run_id, batch, report, pool)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a batch left early: the GETs not started are dropped
    if merged is not None:
        _write(store, run_id, batch, row_group_groups, report, merged)


def _read_members(store: ObjectShardStore, run_id: str, batch: list[CommitRecord], report: CompactReport,
                  pool: ThreadPoolExecutor) -> pa.Table | None:
    """The members' rows, each member checked against its record; None (and why in `report`) if one fails."""
    tables = []
    for record, path, get in _members(store, run_id, batch, pool):
        try:
            data = get.result()
        except OSError as error:
            report.skipped.append(f"shard {path} is unreadable: {error}")
            return None
        if len(data) != record.bytes or hashlib.sha256(data).hexdigest() != record.sha256:
            report.skipped.append(f"shard {path} does not match its record (size or sha256)")
            logger.error("run %s: shard %s does not match its record; its batch is left as it is", run_id, path)
            return None
        tables.append(pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True).read(use_threads=False))
    return pa.concat_tables(tables).cast(GROUP_SCHEMA)


def _write(store: ObjectShardStore, run_id: str, batch: list[CommitRecord], row_group_groups: int,
           report: CompactReport, merged: pa.Table) -> None:
    sink = pa.BufferOutputStream()
    pq.write_table(merged, sink, row_group_size=row_group_groups, write_page_checksum=True, **PARQUET_OPTIONS)
    data = sink.getvalue()
    name = f"compact-{batch[0].shard.removesuffix('.parquet')}-{uuid.uuid4().hex[:8]}.parquet"
    record = {
        "compact": name, "run_id": run_id, "rows": merged.num_rows, "bytes": data.size,
        "sha256": hashlib.sha256(memoryview(data)).hexdigest(),
        "members": [{k: v for k, v in asdict(r).items() if k not in ("skipped", "file", "row_offset", "index")} for r in batch],
        "committed_at": datetime.now(timezone.utc).isoformat(),
    }
    try:
        with store.fs.open_output_stream(store.shard_path(run_id, name)) as out:
            out.write(data)
        _reached("written")
        with store.fs.open_output_stream(store.compaction_path(run_id, name)) as out:  # the commit point
            out.write(json.dumps(record, sort_keys=True).encode())
        _reached("logged")
    except OSError as error:
        raise StoreError(f"compaction of {run_id} on store {store.url} failed: {' '.join(str(error).split())}") from None
    report.files.append(name)
    report.shards += len(batch)
    report.rows += merged.num_rows
    report.bytes_in += sum(r.bytes for r in batch)
    report.bytes_out += data.size
    logger.info("run %s: merged %d shards (%d rows) into %s (%d bytes)", run_id, len(batch), merged.num_rows, name, data.size)


def finish_compactions(store: ObjectShardStore, run_id: str, keep_members_s: float = KEEP_MEMBERS_S) -> list[str]:
    """Steps 3 and 4 of compactions already recorded: delete their members' commit records, and their member
    shard objects where the record is `keep_members_s` old. Returns the paths deleted."""
    compacted = store.committed(run_id)  # lists commits/ and compactions/ (new ones only)
    moved = {shard: record for shard, record in compacted.items() if record.file}
    if not moved:
        return []
    old_enough = (datetime.now(timezone.utc) - timedelta(seconds=keep_members_s)).isoformat()
    compacted_at = store.compactions(run_id)
    listing = {i.base_name: i.path for prefix in ("commits", "shards")
               for i in store.fs.get_file_info(pafs.FileSelector(f"{store.base}/{run_id}/{prefix}", allow_not_found=True))}
    doomed = [listing[f"{shard}.json"] for shard in moved if f"{shard}.json" in listing]
    doomed += [listing[shard] for shard, record in moved.items()
               if shard in listing and compacted_at.get(record.file, "~") <= old_enough]
    for path in doomed:
        try:
            store.fs.delete_file(path)
        except FileNotFoundError:
            pass
        _reached("removing")
    return doomed


def compact_store_run(store: ShardStore | ObjectShardStore, run_id: str, *, target_bytes: int = DEFAULT_TARGET_BYTES,
                      flush: bool = True, workers: int | None = None) -> CompactReport:
    """One run's compaction on whichever backend `store` is: a local or shared path (factory/store_compact.py, with
    `workers` processes writing the merged files) or an object store (this module: one process, `workers` unused;
    its merge waits mostly for GETs and PUTs, which `_members` already overlaps)."""
    if isinstance(store, ObjectShardStore):
        return compact_object_run(store, run_id, target_bytes=target_bytes, flush=flush)
    return compact_run(store, run_id, target_bytes=target_bytes, flush=flush, workers=workers)
