"""Compaction: merge a run's committed shards into larger files, recorded in the commit log as one record.

A run written by many workers is many small shards (a chunk every few
seconds each); readers, followers and filesystems pay per file. `compact_run`
merges committed shards, in commit order, into files of about `target_bytes`
and appends one compaction record per merged file to the run's commit log:

    {"compact": "<file>", "members": [[shard, rows, sha256], ...], "rows", "bytes", "sha256", "index", ...}

("index", where the merged file's rows come in long enough runs: its index columns as runs of equal rows,
factory/index_runs.py, which run-api's start-up makes into the columns instead of reading them.)

The shards keep their names and their row numbers: a member's rows are the
rows `row_offset .. row_offset + rows` of the merged file, in the order of
`members`, so everything keyed by (run, shard, row) (run-api's served state,
resumed writers skipping committed chunks) stays right; `ShardStore.locate`
says where a shard's rows are now.

Steps (each safe to be killed after):
1. the merged file is written under a hidden temporary name and fsynced, with
   its directory; the members are read only after their size and sha256 are
   checked against the log. Nothing is decoded where it can be helped: small
   members' pages are gathered into row groups of many members
   (factory/parquet_pages.py), large members' row groups copied as they are
   (factory/parquet_concat.py); where neither is possible (see `compact_run`),
   their rows are re-encoded;
2. under the run's lock, the members are checked to be still committed as they
   were (not replaced meanwhile), and the record is appended (the commit point:
   a checked line, fsynced; see commit_log.py);
3. the merged file is renamed to its visible name;
4. the member files are removed (several at a time: each removal mostly waits for the filesystem).
A kill before 2 leaves a hidden temporary file (repair removes stale ones) and
the shards as they were; after 2, the next commit, read or `repair` of the
run finishes 3 and 4 from the log. Step 1 touches nothing but its temporary
file, so it runs in worker processes (`compact_run(workers=N)`, up to N + 1
batches ahead) while steps 2-4 stay in the compaction's own process, one merged
file at a time and in plan order; the workers die with that process. Compaction runs beside live writers: they
only wait for the lock during step 2.

A run-api following the run when it is compacted reads the queued groups of
the merged shards from the merged file once its follower has seen the record
(within `follow_interval_s`; a /batch formed from a removed member file in
between answers 503 and takes nothing, and the trainer retries). What it served
before stays served: the served state is keyed by shard name and row.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from factory.commit_log import encode_line, fsync_dir
from factory.gc_pause import gc_paused
from factory.index_runs import INDEX_COLUMNS, summarize
from factory.parquet_concat import ConcatRefused, ParquetConcat
from factory.parquet_pages import PageMerge
from factory.schema import GROUP_SCHEMA
from factory.store import (MANIFEST_EVERY_LINES, PARQUET_OPTIONS, CommitRecord, RecordMaybeLogged, ShardStore, StoreError,
                           _sha256, _write_failure, save_manifest)
from factory.store_records import Block, Loose

logger = logging.getLogger(__name__)

DEFAULT_TARGET_BYTES = 256 << 20
COPY_MIN_SHARD_BYTES = 1 << 20
"""Copy row groups only where the members average this many bytes: smaller shards' pages are gathered into row
groups of `row_group_groups` groups (or, where they cannot be, their rows re-encoded). Copied, each member keeps its
own row groups (one or more), and a file of thousands of ~36 kB row groups has a footer of ~3.5 kB per row group that
every open parses (~7 MB for 2,000 shards): measured on such a file, run-api drained ~1.5 batches/s instead of ~100
and exports ran 5-8x slower (bench/RESULTS.md)."""
METHODS = ("row_groups", "pages", "decode")
PARALLEL_HASH_BYTES = 1 << 20
"""Members this large are checked against their sha256 on a second thread while they are copied."""
READ_AHEAD_BYTES = 32 << 20
"""Members whose reading is asked of the kernel (`posix_fadvise(WILLNEED)`) up to this many bytes ahead of the one
being merged (see `_Members`)."""
READ_AHEAD_WAIT_S = 0.01
"""How long the read-ahead thread sleeps when it is `READ_AHEAD_BYTES` ahead (32 MB are ~0.15 s of merging)."""
WRITE_BACK_BYTES = 16 << 20
"""While a merged file is written, its data is handed to the disk every this many bytes (see `_WriteBack`)."""
UNLINK_THREADS = 16
"""Threads removing merged members (each mostly waits in the kernel; see `_Removals`)."""
MAX_DEFAULT_WORKERS = 4
"""Most worker processes `default_workers()` chooses (each merges ~200 MB/s of tiny shards on one core here; a few
saturate a disk)."""
PARALLEL_MIN_BYTES = 64 << 20
"""Compactions of fewer bytes than this stay in one process: forking the workers and handing them the batches
costs more than the ~0.3 s they can save."""
OLD_WRITER_WINDOW = 64 << 10
"""Bytes at the end of the log checked for records without a checksum (an old writer still appending)."""
PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal a process gets when its parent ends."""


@dataclass
class CompactReport:
    run_id: str
    files: list[str] = field(default_factory=list)
    """Merged files committed."""
    shards: int = 0
    rows: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)
    """Why a batch of shards was left as it was (replaced meanwhile, damaged)."""
    copied: int = 0
    """Merged files written by copying the members' row groups (factory/parquet_concat.py)."""
    paged: int = 0
    """Merged files written by gathering the members' pages into larger row groups (factory/parquet_pages.py)."""
    decoded: list[str] = field(default_factory=list)
    """Why a merged file was written by decoding and re-encoding its members instead (one entry per file)."""

    @property
    def mb_per_s(self) -> float:
        return self.bytes_in / 1e6 / self.seconds if self.seconds else 0.0


def _reached(point: str) -> None:
    """A named step of a compaction; the kill -9 tests replace this to die exactly here."""


def check_writers_are_current(store: ShardStore, run_id: str) -> None:
    """Refuse a run whose log still grows with records of a version before checked lines (and so before
    compaction records): such a writer reads a compacted shard as missing."""
    path = store.commit_log(run_id)
    size = path.stat().st_size
    with open(path, "rb") as log:
        log.seek(max(0, size - OLD_WRITER_WINDOW))
        tail = log.read().split(b"\n")[1 if size > OLD_WRITER_WINDOW else 0 :]
    if any(line.strip() and b'"check": "' not in line for line in tail):
        raise StoreError(
            f"run {run_id} is being written by an older factory version (records without a checksum at the end of "
            f"{path}): stop or upgrade its writers, then compact"
        )


def plan(records: list[CommitRecord], target_bytes: int, *, flush: bool, min_shards: int = 2) -> list[list[CommitRecord]]:
    """Batches of not yet compacted shards, in commit order, of about `target_bytes` each.

    The last, smaller batch is merged only with `flush` (otherwise it waits for more shards)."""
    batches: list[list[CommitRecord]] = []
    current: list[CommitRecord] = []
    size = 0
    for record in records:
        if record.file:
            continue
        if current and size + record.bytes > target_bytes:
            batches.append(current)
            current, size = [], 0
        current.append(record)
        size += record.bytes
    if current and (flush or size >= target_bytes):
        batches.append(current)
    return [batch for batch in batches if len(batch) >= min_shards]


def compact_run(
    store: ShardStore,
    run_id: str,
    *,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    flush: bool = True,
    row_group_groups: int = 256,
    progress: Callable[[str], None] | None = None,
    copy: bool | None = None,
    copy_min_shard_bytes: int = COPY_MIN_SHARD_BYTES,
    method: str | None = None,
    workers: int | None = None,
) -> CompactReport:
    """Merge the run's shards into files of about `target_bytes` (see the module docstring).

    `workers` processes write the merged files (step 1) while this one commits them (steps 2-4), one at a time and
    in plan order, as a single process would (see `_merge_in_workers`); None: `default_workers()`; 1, a compaction
    of one batch or under PARALLEL_MIN_BYTES, or a daemonic process (which may not start any): all in this process.

    How a merged file is written (`method`; by default chosen per file):
    - "row_groups": the members' row groups copied as they are (factory/parquet_concat.py), the default where the
      members average at least `copy_min_shard_bytes`;
    - "pages": the members' pages gathered, not decoded, into row groups of at least `row_group_groups` groups
      (factory/parquet_pages.py), the default for smaller members;
    - "decode": the members decoded and re-encoded in row groups of `row_group_groups` groups; also wherever the
      first two are refused (members of different schemas or writers, dictionary pages as in shards written before
      PARQUET_OPTIONS turned dictionaries off, something unexpected in a footer: logged).
    `copy=True` / `copy=False` are the older spellings of "row_groups" / "decode". Either way a member's rows are
    the same rows of the merged file."""
    if method is None and copy is not None:
        method = "row_groups" if copy else "decode"
    if method is not None and method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
    if not store.commit_log(run_id).is_file():
        raise StoreError(f"run {run_id} has no commit log at {store.commit_log(run_id)}; check the store root and the run id")
    check_writers_are_current(store, run_id)
    report = CompactReport(run_id)
    start = time.perf_counter()
    removals = _Removals(store, run_id)
    # No cyclic garbage collection while merging: the log's records (an object or more per shard, none of them
    # garbage) are walked by every full collection, and each merged file's record moves thousands of them (~6% of
    # the compaction's CPU at 100k shards, bench/RESULTS.md). What is allocated meanwhile is freed by reference counts.
    with gc_paused():
        try:
            # records not compacted yet, in commit order (blocks of members compacted before are skipped whole)
            pending = [record for item in store._read_log(run_id, checkpoint=False).records.items_in_order()
                       if type(item) is not Block for record in (item.records() if type(item) is Loose else (item,))]
            batches = plan(pending, target_bytes, flush=flush)
            hows = [method or ("row_groups" if sum(r.bytes for r in batch) >= copy_min_shard_bytes * len(batch)
                               else "pages") for batch in batches]
            workers = default_workers() if workers is None else workers
            if workers > 1 and multiprocessing.current_process().daemon:
                # a daemonic process may not start children (multiprocessing's pool workers, Dask's worker processes)
                logger.info("run %s: compacting in this process (it is daemonic: no worker processes)", run_id)
                workers = 1

            def merged(batch: list[CommitRecord], name: str | None) -> None:
                if name and progress:
                    progress(f"{run_id}: merged {len(batch)} shards into {name}")

            if workers > 1 and len(batches) > 1 and sum(r.bytes for b in batches for r in b) >= PARALLEL_MIN_BYTES:
                _merge_in_workers(store, run_id, batches, hows, row_group_groups, report, removals,
                                  min(workers, len(batches)), merged)
            else:
                for batch, how in zip(batches, hows):
                    merged(batch, _merge(store, run_id, batch, row_group_groups, report, how, removals))
        finally:
            removals.finish()
        if report.shards >= MANIFEST_EVERY_LINES:
            checkpoint(store, run_id)
    report.seconds = time.perf_counter() - start
    return report


def checkpoint(store: ShardStore, run_id: str) -> None:
    """Save the run's manifest as the log stands after the compaction records.

    A store checkpoints its manifest by lines appended (store.MANIFEST_EVERY_LINES), but one compaction record moves
    thousands of shards: left to that rule, every reader started afterwards (viewer, run-api, export) would parse
    the records and move each member again (at 50k shards compacted, ~1 s of the viewer's first page). The manifest
    is a cache (written aside and renamed; the log stays the record), so a kill here loses nothing. Done only where
    the compaction moved at least MANIFEST_EVERY_LINES shards: re-applying fewer costs a reader milliseconds, and
    saving costs the compactor the manifest's size plus, once per process, pyarrow's import of pandas (~0.5 s).
    (Many small compactions in a row still leave their records to every reader until the log's own rule saves a
    manifest: counting moved shards, not lines, in that rule would cover them.)"""
    log = store._read_log(run_id)
    with store._logs_lock:  # not held by _read_log once it returns; keeps other threads' parsing out while saving
        if log.lines > log.checkpoint_lines:
            save_manifest(store.manifest_path(run_id), log)


def _merge(store: ShardStore, run_id: str, batch: list[CommitRecord], row_group_groups: int, report: CompactReport,
           how: str = "pages", removals: _Removals | None = None) -> str | None:
    """Merge one batch in this process: step 1 (`_build`), then steps 2-4 (`_commit`)."""
    name, tmp = _names(store.shards_dir(run_id), batch)
    built = _build(os.fspath(store.shards_dir(run_id)), _members_of(batch), row_group_groups, how, name, tmp)
    return _commit(store, run_id, batch, built, report, removals)


def default_workers() -> int:
    """Worker processes for a compaction on this machine: one per core this process may run on, at most
    MAX_DEFAULT_WORKERS (1, all in one process, on a single core)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_WORKERS, cores))


def _merge_in_workers(store: ShardStore, run_id: str, batches: list[list[CommitRecord]], hows: list[str],
                      row_group_groups: int, report: CompactReport, removals: _Removals, workers: int,
                      merged: Callable[[list[CommitRecord], str | None], None]) -> None:
    """`_merge` of each batch with step 1 (`_build`: read, check, write and fsync the temporary file, its index
    summary) in `workers` processes, up to `workers` + 1 batches ahead, and steps 2-4 (`_commit`) here, in plan
    order: the log gets the same records, in the same order, under the same lock as from one process. Merging is
    CPU-bound on one core (~160 us a tiny member: footer parsing, two sha256, reads and writes), committing is not.

    Workers are forked (a spawned one imports pyarrow, ~0.3 s a worker), before the compaction starts any thread
    of its own (its read-ahead, write-back and removal threads), and die with it (`_worker_started`): a kill -9 of the compaction leaves at most their hidden temporary
    files, never a record, as a kill of a single process does (repair removes stale ones). A worker's error fails
    its batch as it would in one process: the batches before it stay committed, the later ones are abandoned, the
    workers stopped and the temporary files of every uncommitted batch removed before it is raised. A worker's
    death does the same, except that it breaks the pool: batches built but not yet committed are abandoned too."""
    directory = os.fspath(store.shards_dir(run_id))
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_started, initargs=(os.getpid(),))
    queued = iter(zip(batches, hows))
    ahead: deque[tuple[list[CommitRecord], str, Future[_Built]]] = deque()

    def submit(limit: int) -> None:
        while len(ahead) < limit and (item := next(queued, None)) is not None:
            batch, how = item
            name, tmp = _names(store.shards_dir(run_id), batch)
            ahead.append((batch, tmp, pool.submit(_build, directory, _members_of(batch), row_group_groups, how, name, tmp)))

    try:
        submit(workers + 1)  # one batch queued beyond those being built: the next worker to finish goes on at once
        while ahead:
            batch, _tmp, job = ahead[0]
            built = job.result()
            submit(workers + 2)  # before this batch leaves `ahead`: its file is removed below if this fails
            ahead.popleft()
            merged(batch, _commit(store, run_id, batch, built, report, removals))
    except BrokenProcessPool as error:
        raise StoreError(f"run {run_id}: a compaction worker process died (killed, or out of memory?); the files "
                         "merged before it are committed, the shards not merged yet left as they were: compact "
                         "again") from error
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for _batch, tmp, _job in ahead:  # the workers are stopped: nothing writes these any more
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


def _worker_started(parent: int) -> None:
    """A compaction worker's first step: die with the compaction (Linux: SIGKILL when its parent ends, however it
    ends), and leave Ctrl-C to the parent, which stops the workers and removes their temporary files."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent ended before the line above
        os._exit(1)


def _names(shards: Path, batch: list[CommitRecord]) -> tuple[str, str]:
    """The merged file's name and the hidden temporary name it is written under."""
    name = f"compact-{Path(batch[0].shard).stem}-{uuid.uuid4().hex[:8]}.parquet"
    return name, os.path.join(os.fspath(shards), f".{name}.{uuid.uuid4().hex[:12]}.tmp")


class _Member(NamedTuple):
    """What step 1 needs of a member's commit record (sent to a worker process: a tuple pickles in a fraction of
    the time of a `CommitRecord`)."""

    shard: str
    rows: int
    bytes: int
    sha256: str


def _members_of(batch: list[CommitRecord]) -> list[_Member]:
    return [_Member(r.shard, r.rows, r.bytes, r.sha256) for r in batch]


@dataclass
class _Built:
    """Step 1's result: the temporary file `tmp` holding the merged rows (fsynced, with its directory entry), or
    `problem` (why a member cannot be merged; `tmp` then removed)."""

    name: str
    tmp: str
    how: str
    rows: int = 0
    size: int = 0
    checksum: str = ""
    problem: str | None = None
    refused: str | None = None
    """Why the members were decoded and re-encoded instead of copied (None: they were copied)."""
    summary: dict[str, Any] | None = None
    """The index summary for the record (see `_index_summary`)."""
    notes: list[str] = field(default_factory=list)
    """Warnings for the caller to log (a worker process logs nothing itself: its handlers are the parent's copies)."""


def _build(directory: str, batch: list[_Member], row_group_groups: int, how: str, name: str, tmp: str) -> _Built:
    """Step 1 of a merge: the members, read and checked, merged into `tmp`. Touches nothing but `tmp` (removed here
    on any error or problem), so it runs as well in a worker process as in the compaction's own."""
    shards, path = Path(directory), Path(tmp)
    built = _Built(name, tmp, how)
    kept = False
    try:
        try:
            checksum: str | None = None
            if how == "decode":
                built.refused = "asked to decode"
            else:
                try:
                    if how == "row_groups":
                        built.rows, built.problem, checksum = _write_concatenated(shards, path, batch)
                    else:
                        built.rows, built.problem, checksum = _write_pages(shards, path, batch, row_group_groups)
                except ConcatRefused as error:
                    built.refused = str(error)
                    built.notes.append(f"merging {len(batch)} shards (first {batch[0].shard}) by decoding them: their "
                                       f"{'row groups' if how == 'row_groups' else 'pages'} cannot be copied as they "
                                       f"are: {built.refused}")
            if built.refused is not None:
                built.rows, built.problem = _write_merged(shards, path, batch, row_group_groups)
            if built.problem:
                return built
            built.size = path.stat().st_size
            built.checksum = checksum if checksum is not None else _sha256(path)
            fsync_dir(shards)
        except OSError as error:
            raise _write_failure("writing compacted file", path, error) from error
        built.summary = _index_summary(path, built.rows, built.notes)
        kept = True
        return built
    finally:
        if not kept:
            path.unlink(missing_ok=True)


def _commit(store: ShardStore, run_id: str, batch: list[CommitRecord], built: _Built, report: CompactReport,
            removals: _Removals | None = None) -> str | None:
    """Steps 2-4 of a merge, in the compaction's own process: the record appended under the run's lock (if the
    members are still committed as they were), the rename, the members' removal. `built.tmp` is removed unless
    the record was (or may have been) appended."""
    shards = store.shards_dir(run_id)
    name, tmp = built.name, Path(built.tmp)
    for note in built.notes:
        logger.warning("run %s: %s", run_id, note)
    logged = False
    try:
        if built.problem:
            report.skipped.append(built.problem)
            logger.error("run %s: %s; those shards are left as they are", run_id, built.problem)
            return None
        _reached("written")
        record = {
            "compact": name, "run_id": run_id, "rows": built.rows, "bytes": built.size, "sha256": built.checksum,
            "members": [[r.shard, r.rows, r.sha256] for r in batch],
            "committed_at": datetime.now(timezone.utc).isoformat(),
        }
        if built.summary is not None:
            record["index"] = built.summary
        with store._locked(run_id):
            # not `committed`: a copy of the whole history per file; and no manifest saved per merged file (each
            # record moves thousands of shards, so the store's rule would save one every few files: ~50 us per
            # shard of the compaction's time on 20k shards); `checkpoint` saves it once at the end
            current = store._read_log(run_id, checkpoint=False).records
            changed = [r.shard for r in batch if current.get(r.shard) != r]
            if changed:
                report.skipped.append(f"{len(changed)} shards (first {changed[0]}) were replaced while being merged")
                return None
            try:
                store._append_record(run_id, encode_line(record), "the compaction record of " + name)
            except RecordMaybeLogged:
                logged = True  # keep the file, so the next read can finish the compaction
                raise
            logged = True
            _reached("logged")
            os.replace(tmp, shards / name)
            fsync_dir(shards)
            _reached("renamed")
            paths = [os.path.join(os.fspath(shards), member.shard) for member in batch]
            _remove(paths[:1])
            _reached("removing")
        own = removals is None
        removals = removals or _Removals(store, run_id)
        removals.start(paths[1:])  # the rest while the next batch is merged, under the run's lock (see _Removals)
        if own:
            removals.finish()
    finally:
        if not logged:
            tmp.unlink(missing_ok=True)
    report.files.append(name)
    if built.refused is None and built.how == "row_groups":
        report.copied += 1
    elif built.refused is None:
        report.paged += 1
    else:
        report.decoded.append(built.refused)
    report.shards += len(batch)
    report.rows += built.rows
    report.bytes_in += sum(r.bytes for r in batch)
    report.bytes_out += built.size
    logger.info("run %s: merged %d shards (%d rows) into %s (%d bytes)", run_id, len(batch), built.rows, name, built.size)
    return name


def _index_summary(path: Path, rows: int, notes: list[str]) -> dict[str, Any] | None:
    """The merged file's index columns as runs (factory/index_runs.py), read back from it while it is in the page
    cache: run-api's start-up then makes them instead of decoding them. None where they change too often, or
    cannot be read (the file is checked like any other when it is served; why is added to `notes`)."""
    try:
        with pq.ParquetFile(path) as parquet:
            index = parquet.read(columns=INDEX_COLUMNS, use_threads=False)
    except (OSError, pa.ArrowException) as error:
        notes.append(f"no index summary for {path}: {error}")
        return None
    return summarize(index) if index.num_rows == rows else None


def _remove(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class _Removals:
    """Merged members' files (retired by the log, the merged file in place) removed `UNLINK_THREADS` at a time, on
    a background thread while the next batch is merged; `finish` waits for them and makes the removals durable.

    On this machine's ext4 (mounted with `discard`) removing a shard whose blocks are on disk waits ~0.4-1.1 ms
    in the kernel, mostly for the journal, not the CPU: one at a time, in line, that was most of a compaction's
    time (bench/RESULTS.md, issue 34 compaction throughput). Each batch's removals hold the run's lock, as when
    they were done in line: a shard committed again under its name meanwhile (`commit(replace=True)`, repair) is
    not removed. A kill leaves retired files that the next commit, read or repair removes, as before."""

    def __init__(self, store: ShardStore, run_id: str) -> None:
        self.store, self.run_id = store, run_id
        self.background: ThreadPoolExecutor | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.jobs: list[Future[None]] = []
        self.removed = False

    def start(self, paths: list[str]) -> None:
        self.removed = True
        if len(paths) < 2 * UNLINK_THREADS:
            with self.store._locked(self.run_id):
                _remove(paths)
            return
        if self.background is None:
            self.background = ThreadPoolExecutor(1, thread_name_prefix="compact-remove")
            self.pool = ThreadPoolExecutor(UNLINK_THREADS, thread_name_prefix="compact-unlink")
        self.jobs.append(self.background.submit(self._remove_locked, paths))

    def _remove_locked(self, paths: list[str]) -> None:
        assert self.pool is not None
        with self.store._locked(self.run_id):
            for done in [self.pool.submit(_remove, paths[i::UNLINK_THREADS]) for i in range(UNLINK_THREADS)]:
                done.result()

    def finish(self) -> None:
        try:
            for job in self.jobs:
                job.result()
        finally:
            for pool in (self.background, self.pool):
                if pool is not None:
                    pool.shutdown()
            self.background = self.pool = None
            self.jobs = []
        if self.removed:
            fsync_dir(self.store.shards_dir(self.run_id))
            self.removed = False


class _Members:
    """The members of a batch, in order, opened one at a time as they are merged, while a thread walks ahead of them
    (up to `ahead_bytes`) asking the kernel to read them (open, `posix_fadvise(WILLNEED)`, close): members of a
    real compaction are old files, mostly no longer in the page cache (at 1M shards the store is larger than this
    machine's memory), and read one at a time each read waited for the disk. Asking for the read-ahead on this
    thread cost ~36 us a member (the call queues the reads and waits for the block layer); the walking thread
    needs the interpreter only a few us per member and hands nothing back: what it reads only warms the cache.

        with _Members(directory, batch) as members:
            for record, path, fd in members:   # fd None: the member is missing
                ...                            # read and close fd

    What is read is what the member's file holds when this thread opens it, checked against the log's size and
    sha256 as before. Leaving the loop stops the walking thread (joined on exit)."""

    def __init__(self, directory: str, batch: list[_Member], ahead_bytes: int = READ_AHEAD_BYTES) -> None:
        self.batch, self.ahead_bytes = batch, ahead_bytes
        self.paths = [os.path.join(directory, record.shard) for record in batch]
        self.flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        self.position = 0
        """The member being merged: the walking thread stays within `ahead_bytes` of its start."""
        self.stopped = False
        self.thread: threading.Thread | None = None

    def _read_ahead(self) -> None:
        advise, flags, batch, paths = os.posix_fadvise, self.flags, self.batch, self.paths
        starts = [0]
        for record in batch:
            starts.append(starts[-1] + record.bytes)
        for index in range(1, len(batch)):
            # the member after the one being merged is always asked for (even one larger than `ahead_bytes`)
            while index > self.position + 1 and starts[index + 1] - starts[self.position] > self.ahead_bytes:
                if self.stopped:
                    return
                time.sleep(READ_AHEAD_WAIT_S)
            if self.stopped:
                return
            if index <= self.position:
                continue  # the merge got there first
            try:
                fd = os.open(paths[index], flags)
            except OSError:
                continue  # the merge reports it
            try:
                advise(fd, 0, batch[index].bytes, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # only a hint
            finally:
                os.close(fd)

    def __enter__(self) -> _Members:
        return self

    def __iter__(self) -> Iterator[tuple[_Member, str, int | None]]:
        if len(self.batch) > 1 and self.ahead_bytes > 0 and hasattr(os, "posix_fadvise"):
            self.thread = threading.Thread(target=self._read_ahead, name="compact-read-ahead", daemon=True)
            self.thread.start()
        flags = self.flags
        for index, (record, path) in enumerate(zip(self.batch, self.paths)):
            self.position = index
            try:
                fd: int | None = os.open(path, flags)
            except FileNotFoundError:
                fd = None
            yield record, path, fd

    def __exit__(self, *exc: object) -> None:
        self.stopped = True
        if self.thread is not None:
            self.thread.join()
            self.thread = None


class _WriteBack:
    """`fdatasync` of the merged file on a second thread every `WRITE_BACK_BYTES` written, so that the fsync before
    the compaction record (still on the merging thread, still before the record) waits only for the last bytes
    instead of the whole file (~50 ms a 128 MB file here, ~17 us a 36 kB member). An error of a background sync is
    raised by `finish` (Linux reports a write-back error to one fsync of a file description only: the final fsync
    could no longer see it). `close` waits for it in any case, before the file is closed."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.unsynced = 0
        self.pool: ThreadPoolExecutor | None = None
        self.job: Future[None] | None = None

    def wrote(self, size: int) -> None:
        self.unsynced += size
        if self.unsynced >= WRITE_BACK_BYTES and (self.job is None or self.job.done()):
            if self.job is not None:
                self.finish()
            if self.pool is None:
                self.pool = ThreadPoolExecutor(1, thread_name_prefix="compact-write-back")
            self.job = self.pool.submit(os.fdatasync, self.fd)
            self.unsynced = 0

    def finish(self) -> None:
        job, self.job = self.job, None
        if job is not None:
            job.result()

    def close(self) -> None:
        try:
            if self.job is not None:
                self.job.exception()  # waits; an error is `finish`'s to raise (here the merge failed already)
        finally:
            self.job = None
            if self.pool is not None:
                self.pool.shutdown()
                self.pool = None


def _read_member(fd: int, size: int) -> bytes:
    """The file's bytes, up to `size` + 1 (one more than the log says tells a longer file); the caller closes `fd`."""
    data = os.read(fd, size + 1)
    while len(data) <= size:  # a short read (large files, some filesystems): read on
        more = os.read(fd, size + 1 - len(data))
        if not more:
            break
        data += more
    return data


def _member_bytes(member: int | None, record: _Member, path: Any) -> tuple[bytes | None, str | None]:
    """A member's bytes read from its open descriptor (closed here), or None and why it cannot be merged (missing,
    or not the size its commit record says); the sha256 check is the caller's (one merge hashes on a thread)."""
    if member is None:
        return None, f"shard {path}: missing"
    try:
        data = _read_member(member, record.bytes)
        size = len(data) if len(data) <= record.bytes else os.fstat(member).st_size
    finally:
        os.close(member)
    if size != record.bytes:
        return None, f"shard {path}: size is {size} bytes, commit log says {record.bytes} (truncated or overwritten)"
    return data, None


def _write_concatenated(shards: Path, tmp: Path, batch: list[_Member]) -> tuple[int, str | None, str | None]:
    """Write the members' row groups, in order and as they are, to `tmp`; (rows, None, sha256 of `tmp`) or
    (0, why a member cannot be merged, None). Raises `ConcatRefused` where they cannot be copied as they are.

    Each member is read once: the bytes copied are the bytes checked against the log's size and sha256 (the
    same checks, and the same reasons, as `ShardStore._check`); its pages and their CRCs are not touched.
    Hashing is most of the work (each byte is hashed twice: as a member, and as part of `tmp`), so a large
    member's check runs on a second thread while it is copied (hashlib lets go of the GIL); a member found
    damaged only after it was copied leaves `tmp` to be removed like any other unfinished merge."""
    digest = hashlib.sha256()

    def write(data: Any) -> None:
        digest.update(data)
        handle.write(data)
        write_back.wrote(len(data))

    def checksum(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    rows = 0
    with open(tmp, "wb") as handle, ThreadPoolExecutor(1, thread_name_prefix="compact-hash") as hasher, \
            _Members(os.fspath(shards), batch) as members:
        write_back = _WriteBack(handle.fileno())
        try:
            concat = ParquetConcat(handle, write)
            for record, path, member in members:
                data, problem = _member_bytes(member, record, path)
                if data is None:
                    return 0, problem, None
                corrupt = f"shard {path}: sha256 differs from the commit log (corrupt)"
                if len(data) < PARALLEL_HASH_BYTES:
                    if checksum(data) != record.sha256:
                        return 0, corrupt, None
                    held = concat.add(data, str(path))
                else:
                    check = hasher.submit(checksum, data)
                    try:
                        held = concat.add(data, str(path))
                    except ConcatRefused:
                        if check.result() != record.sha256:
                            return 0, corrupt, None
                        raise
                    if check.result() != record.sha256:
                        return 0, corrupt, None
                if held != record.rows:
                    return 0, f"shard {path} holds {held} rows, commit log says {record.rows}", None
                rows += held
            concat.finish()
            handle.flush()
            write_back.finish()
            os.fsync(handle.fileno())
        finally:
            write_back.close()
    return rows, None, digest.hexdigest()


def _write_pages(shards: Path, tmp: Path, batch: list[_Member], row_group_groups: int) -> tuple[int, str | None, str | None]:
    """Write the members' rows, in order, to `tmp`, their pages gathered into row groups of at least
    `row_group_groups` rows (factory/parquet_pages.py); (rows, None, sha256 of `tmp`) or (0, why a member cannot be
    merged, None). Raises `ConcatRefused` where the pages cannot be gathered as they are.

    Each member is read with one read of its whole file and checked against the log's size and sha256 (the same
    checks, and the same reasons, as `ShardStore._check`) before its footer is parsed; what is gathered is hashed
    and written once per output row group. All on this thread: with the hashing on a second one (as before), each
    member's open, read and close handed the GIL over and waited to get it back, which under load cost more than
    the hashing it overlapped (bench/RESULTS.md, issue 34 compaction throughput)."""
    digest = hashlib.sha256()
    rows = 0
    written: list[Any] = []
    directory = os.fspath(shards)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
    write_back = _WriteBack(fd)

    def write() -> None:
        for piece in written:
            digest.update(piece)
            view = memoryview(piece)
            while view:  # a short write goes on where it stopped
                view = view[os.write(fd, view):]
            write_back.wrote(len(piece))
        written.clear()

    try:
        merge = PageMerge(written.append, row_group_groups)
        with _Members(directory, batch) as members:
            for record, path, member in members:
                data, problem = _member_bytes(member, record, path)
                if data is None:
                    return 0, problem, None
                if hashlib.sha256(data).hexdigest() != record.sha256:
                    return 0, f"shard {path}: sha256 differs from the commit log (corrupt)", None
                held = merge.add(data, path)
                if held != record.rows:
                    return 0, f"shard {path} holds {held} rows, commit log says {record.rows}", None
                rows += held
                if written:
                    write()
        merge.finish()
        write()
        write_back.finish()
        os.fsync(fd)
    finally:
        write_back.close()
        os.close(fd)
    return rows, None, digest.hexdigest()


def _write_merged(shards: Path, tmp: Path, batch: list[_Member], row_group_groups: int) -> tuple[int, str | None]:
    """Write the members' rows, in order, to `tmp`; (rows, None) or (0, why a member cannot be merged)."""
    rows = 0
    with open(tmp, "wb") as handle:
        writer = pq.ParquetWriter(handle, GROUP_SCHEMA, write_page_checksum=True, **PARQUET_OPTIONS)
        pending: list[pa.Table] = []
        pending_rows = 0
        try:
            for record in batch:
                path = shards / record.shard
                problem = ShardStore._check(path, record, True)
                if problem:
                    return 0, f"shard {path}: {problem}"
                try:
                    # One small file at a time: pyarrow's thread pool only adds overhead here (and cores are shared).
                    table = pq.ParquetFile(path, page_checksum_verification=True).read(use_threads=False)
                except (OSError, pa.ArrowException) as error:
                    return 0, f"shard {path} is unreadable: {error}"
                if table.num_rows != record.rows:
                    return 0, f"shard {path} holds {table.num_rows} rows, commit log says {record.rows}"
                pending.append(table)
                pending_rows += table.num_rows
                if pending_rows >= row_group_groups:
                    writer.write_table(pa.concat_tables(pending), row_group_size=row_group_groups)
                    rows += pending_rows
                    pending, pending_rows = [], 0
            if pending or rows == 0:
                writer.write_table(pa.concat_tables(pending) if pending else GROUP_SCHEMA.empty_table(),
                                   row_group_size=row_group_groups)
                rows += pending_rows
        finally:
            writer.close()
        handle.flush()
        os.fsync(handle.fileno())
    return rows, None


def main_line(report: CompactReport) -> str:
    return (f"{report.run_id}: merged {report.shards} shards ({report.rows} groups, {report.bytes_in / 1e6:.1f} MB) "
            f"into {len(report.files)} files ({report.bytes_out / 1e6:.1f} MB) in {report.seconds:.1f} s "
            f"({report.mb_per_s:.0f} MB/s)"
            + (f"; {len(report.decoded)} by decoding (first because: {report.decoded[0]})" if report.decoded else "")
            + (f"; left as they were: {'; '.join(report.skipped)}" if report.skipped else ""))



