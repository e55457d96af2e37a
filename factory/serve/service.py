"""The batching service: Atropos's trainer/env protocol over a durable queue of shard rows.

One object owns the state every endpoint touches; it runs on the event loop
(heavy work: shard reads, JSON encoding, gzip and commits go to threads).
What Atropos keeps in one process's memory is split three ways here: group
payloads stay in Parquet shards, the queue is a compact in-memory index of
(shard, row), and registration, step and every taken group are persisted in
`ServedState`, so a restarted service rebuilds its queue from the shards and
serves nothing twice.

Where this differs from Atropos 0.4.0 (on purpose):
- /batch forms one batch per call and serves batches oldest first; Atropos
  forms every possible batch at once, counts them all as steps and then pops
  the newest first.
- Mixed-size groups are queued as they are (the packer packs mixed sizes
  exactly) instead of being buffered per env until they add up to group_size.

pyarrow and everything built on it (the store, row building, shard reads) are imported on the first post, the
first queued row or the first commit seen in a followed run, not at start: an idle service stays about as small
as Atropos's (bench.serve's idle RSS).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import gc
import logging
import math
import os
import sqlite3
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterator
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from environments.groups import ScoredGroup
from factory.gc_pause import gc_paused
from factory.serve.config import ServeConfig
from factory.serve.contract import SEQUENCE_FIELDS, PayloadError
from factory.serve.http import gzip_compress, gzip_compressor
from factory.serve.memory import limit_malloc_arenas, return_free_memory
from factory.serve.packer import Entry, LanePolicy, pack_batch
from factory.serve.queue import GroupQueue
from factory.serve.state import DISCARDED, SKIPPED_OVERSIZE, SKIPPED_STALE, ServedState, TakenRows

if TYPE_CHECKING:
    import pyarrow as pa

    from factory.serve.follower import Moved, NewBlock, NewShard
    from factory.serve.ingest import Arrival, GroupCommitter
    from factory.serve.payload import PayloadReader
    from factory.serve.wire import WireGroups
    from factory.store import CommitRecord
    from factory.store_object import StoreReader

logger = logging.getLogger(__name__)

MIN_ENV_WEIGHT = 0.01
"""Floor of the env_weight /status-env returns (Atropos's value), so no env starves."""
NOT_REGISTERED = b'{"status":"error","message":"Trainer not registered. Call /register first.","batch":[]}'
NO_BATCH = b'{"batch":null}'
EMPTY_EXAMPLE = {
    name: []
    for name in ("tokens", "masks", "scores", "advantages", "ref_logprobs", "generation_params", "inference_logprobs", "messages", "images")
}


class BatchBody:
    """A /batch response: the encodings made so far and the (source, row) keys of its rows.

    `raw` is the JSON body (and `gz` its gzip, if made); `arrow` the Arrow IPC stream of the rows, if made.
    The rows themselves are not kept once encoded (a prefetched body would hold them, ~0.6x the JSON's size,
    until served); a client asking for the other format has them read again by `keys`.
    Bodies without rows (no batch, not registered) are JSON only.
    """

    def __init__(self, raw: bytes | memoryview | None = None, gz: bytes | memoryview | None = None,
                 keys: list[tuple[int, int]] | None = None) -> None:
        self.raw, self.gz, self.keys = raw, gz, keys
        self.arrow: bytes | None = None

    def ready(self, arrow: bool, compress: bool) -> bool:
        """Whether it has a body for a client that asks for `arrow` and does (`compress`) or does not take gzip."""
        if arrow:
            return self.arrow is not None
        return self.raw is not None or (compress and self.gz is not None)


UNREADABLE_RETRIES = 16
"""Times a /batch forms its batch again after leaving out the groups of a file that cannot be read."""
FOLD_MIN_SHARDS = 2
"""Consecutive sources that a compaction merged, in order, into one file: folded into one block at a start-up."""
FREEZE_MIN_SOURCES = 10_000
"""Indexed shards from which a start-up freezes what it built (see `_bulk_load`)."""


@contextlib.contextmanager
def _bulk_load(sources: dict[int, Any]) -> Any:
    """No cyclic garbage collection while a start-up builds its state: it allocates an object or more per shard
    (commit records, dict and set entries) and none of them is garbage, yet the collector runs every 700
    allocations and walks everything that survived as the heap grows (4.4 s of a 13 s start-up at 300k shards).
    After a large one (FREEZE_MIN_SOURCES `sources` indexed), what survived is frozen (`gc.freeze`: left out of
    later collections, which would otherwise walk it once more right away, 0.7 s at 300k, and at every full
    collection after; objects are still freed by their reference counts, only cyclic garbage of that moment is
    kept). Process-wide: other threads' cyclic garbage is only found later."""
    with gc_paused():
        try:
            yield
        finally:
            if len(sources) >= FREEZE_MIN_SOURCES:
                gc.freeze()


def _int64s(column: Any, null: int = 0) -> Any:
    """A pyarrow integer column as a numpy int64 array, nulls as `null` (`store_records.int64_values`, imported
    only here: an idle service loads neither numpy nor pyarrow)."""
    from factory.store_records import int64_values

    return int64_values(column, null)


def _ints(column: Any, null: int = 0) -> Any:
    """A pyarrow int32 (or narrower) column as a numpy int32 array, nulls as `null`, with no 64-bit copy
    (`store_records.int32_values`)."""
    from factory.store_records import int32_values

    return int32_values(column, null)


def _taken_positions(taken: TakenRows, ids: Any, starts: Any, counts: Any) -> Any:
    """Ascending positions, among groups queued source by source (`ids[i]` has `counts[i]` rows from position
    `starts[i]`), of the rows `taken` holds; None if there are none. With array operations: a restart after a long
    life leaves millions out."""
    import numpy as np

    if not len(taken) or not len(ids):
        return None
    order = np.argsort(ids, kind="stable")
    at = np.minimum(np.searchsorted(ids[order], taken.sources), len(ids) - 1)
    found = order[at]
    hit = (ids[found] == taken.sources) & (taken.rows >= 0) & (taken.rows < counts[found])
    if not hit.any():
        return None
    # distinct (each source's rows lie in its own span); sorted, not np.unique (a hash table: 0.5 s at 1M taken)
    return np.sort(starts[found[hit]] + taken.rows[hit])


SPAN_GAP = 1 << 16
"""Taken groups closer than this (positions in a start-up's queueing) are left out by one mask over the stretch
between them; the groups between stretches are queued as they are, without a copy."""


def _spans(drop: Any, total: int) -> list[tuple[int, int, Any]]:
    """Positions `0..total` cut into (lo, hi, positions to leave out or None), in order: stretches around the
    ascending `drop` positions, at most SPAN_GAP apart within one, and the untouched ones between them."""
    import numpy as np

    if not len(drop):
        return [(0, total, None)] if total else []
    cuts = np.flatnonzero(np.diff(drop) > SPAN_GAP) + 1
    spans: list[tuple[int, int, Any]] = []
    at = 0
    for out in np.split(drop, cuts):
        lo, hi = int(out[0]), int(out[-1]) + 1
        if lo > at:
            spans.append((at, lo, None))
        spans.append((lo, hi, out))
        at = hi
    if at < total:
        spans.append((at, total, None))
    return spans


class BatchService:
    def __init__(self, config: ServeConfig, handover: dict[str, Any] | None = None) -> None:
        """`handover`: what a recycle's old image left its new one (factory/serve/recycle.py): the commit log stats
        of the runs it had indexed in full and the groups left queued, fewer than a batch. If the logs are still so
        and the served state has just those groups untaken, the service starts dormant: nothing indexed, pyarrow
        not loaded, until there is work (`wake`)."""
        self.config = config
        self._store: StoreReader | None = None
        self._loading = threading.Lock()
        self.state = ServedState(config.resolved_state_path())
        self.queue = GroupQueue()
        self._reader: PayloadReader | None = None
        self._trimmed_at_step = 0  # the step at the last trim after "no batch" (service._drop_cache)
        self.sources: dict[int, Path | str] = {}
        """File of each indexed shard: a local path, or an object's path on the store's filesystem."""
        self.row_offsets: dict[int, int] = {}
        """First row of a source in its file, where a compaction merged it into a larger file."""
        self._source_ids: dict[tuple[str, str], int] = {}
        """(run, shard) -> source, to follow a shard whose rows a compaction moved while the service runs."""
        self._moved: dict[int, tuple[Path | str, int]] = {}
        """(file, first row) of sources a compaction moved while the service runs: one entry, so a read in a worker
        thread sees the old place or the new one, never the new file with the old offset."""
        self._known: set[tuple[str, str]] = set()
        self._block_firsts: list[int] = []
        """First source id of each indexed block of a compacted file's members, ascending (arrival order)."""
        self._block_places: list[tuple[Path | str, Any]] = []
        """(file, numpy array of the row each member starts at) of each block, as `_block_firsts`."""
        self._block_ranges: dict[tuple[str, str], list[tuple[int, int]]] = {}
        """(run, merged file) -> row ranges of it indexed as blocks (their members are known without their names)."""
        self._reported: set[str] = set()
        self._lock = asyncio.Lock()
        self._inflight: dict[str, asyncio.Future[None]] = {}
        self._stored_ids: set[str] = set()
        """Ids of posted groups in committed shards that the state DB has not noted yet (it failed, e.g. a full
        disk): a retry of them is acknowledged without storing them again. The shard is the durable record."""
        self._replay: deque[tuple[int, list[tuple[int, int]]]] = deque()
        self._prefetched: tuple[list[Entry], BatchBody] | None = None
        self._unreadable: set[str] = set()
        """Files whose groups were left out of serving because they could not be read (logged once each)."""
        self._wanted = (False, True)  # (arrow, compressed) of the last /batch: the format the next one is prefetched in
        self._prefetch_task: asyncio.Task[None] | None = None
        self._follow_task: asyncio.Task[None] | None = None
        self.committer: GroupCommitter | None = None
        self._committer_ready: asyncio.Future[None] | None = None
        self._running = False
        self.ingest_budget: Any = None  # set by the app (backpressure.IngestBudget); its numbers go into /status
        self.requesters: list[int] = []
        self.final_status: dict[str, Any] | None = None
        self.last_busy = time.monotonic()
        """When the service last had work (a post, a served batch, a commit, new shards): see `quiet`."""
        self.recycling = False
        """Set by run-api before it stops to recycle: `stop` then notes the commit logs it may stay dormant on."""
        self.handover: dict[str, Any] | None = None
        """Set by `stop` while recycling: what the next image may start dormant on (None: it may not)."""
        self._busy_gaps: deque[float] = deque(maxlen=16)
        self._waking = asyncio.Lock()
        self._wake_task: asyncio.Task[None] | None = None
        self._load()
        self.dormant = handover is not None and self._may_stay_dormant(handover)
        self._handed: dict[str, Any] = handover if self.dormant else {}
        if self.dormant:
            logger.info("served state loaded: step %d, %d groups queued (less than a batch); dormant until there is "
                        "work", self.step, self._handed["queued_groups"])
        else:
            with _bulk_load(self.sources):
                self._load_index()

    # ---- lazily loaded parts (pyarrow) ----
    @property
    def store(self) -> StoreReader:
        if self._store is None:
            with self._loading:  # the follower's thread and the first post's may both get here
                if self._store is None:
                    from factory.serve.ingest import limit_allocator_growth
                    from factory.store_object import open_store

                    limit_allocator_growth()  # before pyarrow allocates anything
                    self._store = open_store(self.config.store_root)
        return self._store

    @property
    def reader(self) -> PayloadReader:
        if self._reader is None:
            from factory.serve.payload import PayloadReader

            self.store  # noqa: B018 - the allocator settings come first
            self._reader = PayloadReader(int(self.config.payload_cache_mb * (1 << 20)), self.store.filesystem)
        return self._reader

    def _may_have_shards(self) -> bool:
        """Whether a followed run may hold committed shards, looked at without importing the store: its directory
        holds something besides this service's state DB. Until then the follower has nothing to scan. A store URL
        (object store) is listed by the follower itself."""
        root = Path(self.config.store_root)
        state = self.config.resolved_state_path()

        def busy(run_dir: Path) -> bool:
            try:
                return any(not entry.name.startswith(state.name) or run_dir != state.parent for entry in os.scandir(run_dir))
            except OSError:
                return False

        if self._store is not None or self.sources or self._block_firsts or "://" in self.config.store_root:
            return True
        if "*" in self.config.follow_runs:
            try:
                return any(entry.is_dir() and busy(Path(entry.path)) for entry in os.scandir(root))
            except OSError:
                return False
        return any(busy(root / run) for run in dict.fromkeys([self.config.ingest_run, *self.config.follow_runs]))

    async def ready_for_posts(self) -> None:
        """Start the group committer (importing pyarrow and the store, in a thread) if it is not running yet."""
        self.note_busy()
        if self.committer is not None:
            return
        await self.wake()
        if self._committer_ready is None:
            self._committer_ready = asyncio.get_running_loop().create_future()
            try:
                await self._start_committer()
            except BaseException as error:
                self._committer_ready.set_exception(error if isinstance(error, Exception) else RuntimeError("cancelled"))
                self._committer_ready.exception()  # retrieved: waiters re-raise it themselves
                self._committer_ready = None
                raise
            self._committer_ready.set_result(None)
            return
        await asyncio.shield(self._committer_ready)

    async def _start_committer(self) -> None:
        def load() -> Any:
            from factory.serve.ingest import GroupCommitter
            from factory.serve.wire import rows_table

            self.store  # noqa: B018 - imports pyarrow and the store here, not on the event loop
            return GroupCommitter, rows_table

        committer_class, rows_table = await asyncio.to_thread(load)
        if not self._running:
            raise RuntimeError("the group committer is not running; start the service before posting groups")
        committer = committer_class(
            self.store,
            self.config.ingest_run,
            self.config.ingest_producer,
            self._on_commit,
            max_groups=self.config.commit_max_groups,
            row_group_groups=self.config.ingest_row_group_groups,
            linger_s=self.config.commit_linger_ms / 1000,
            concurrency=self.config.commit_concurrency,
            linger_queued=self.config.commit_linger_queued,
            pipeline=self.config.commit_pipeline,
            build_table=rows_table,  # posts' DeferredRows are built into Arrow columns once per commit
        )
        committer.start()
        self.committer = committer

    # ---- lifecycle ----
    def _load(self) -> None:
        self.registration: dict[str, Any] | None = self.state.get("registration")
        self.step: int = self.state.get("step", 0)
        self.started: bool = self.state.get("started", False)
        self.envs: list[dict[str, Any]] = self.state.envs()
        self.skipped_stale = self.state.count_taken(SKIPPED_STALE)
        self.skipped_oversize = self.state.count_taken(SKIPPED_OVERSIZE)
        self.unaligned: Counter[str] = Counter(self.state.get("unaligned", {}))
        # Posted groups committed to the store, by env name; durable, so a supervisor polling /status sees progress
        # across run-api restarts (flows/atropos_env.py). Not cleared by /reset_data: the groups stay in the store.
        self.ingested: Counter[str] = Counter(self.state.get("ingested", {}))
        replay_until = self.state.get("replay_until", 0)
        if replay_until > self.step:
            self._replay = deque(b for b in self.state.batches_from(self.step) if b[0] < replay_until)

    # ---- dormant start (after a recycle) ----
    @functools.cached_property
    def followed_logs(self) -> list[Path] | None:
        """The commit logs of the runs this service follows (its ingest run first); None where they cannot be named
        without listing the store ('*', or an object store)."""
        root = self.config.local_store_root
        if "*" in self.config.follow_runs or root is None:
            return None
        return [root / run / "commits.jsonl" for run in dict.fromkeys([self.config.ingest_run, *self.config.follow_runs])]

    def _may_stay_dormant(self, handover: dict[str, Any]) -> bool:
        from factory.serve.recycle import log_stats

        logs = self.followed_logs
        try:
            queued = int(handover["queued_groups"])
            int(handover["queued_sequences"])
            return (logs is not None and not self._replay and log_stats(logs) == handover["logs"]
                    and self.state.untaken_rows() == queued)
        except (KeyError, TypeError, ValueError):
            return False

    def _logs_moved(self) -> bool:
        from factory.serve.recycle import log_stats

        logs = self.followed_logs
        return logs is None or log_stats(logs) != self._handed["logs"]

    def _handover(self) -> dict[str, Any] | None:
        """What the next image may start dormant on, at the end of `stop` while recycling: the followed commit logs
        as of before a last scan that found nothing new, and the groups queued, fewer than a batch."""
        from factory.serve.recycle import log_stats

        logs = self.followed_logs
        if logs is None or self._replay or self._stored_ids or self._unreadable:
            return None
        stats = log_stats(logs)
        if self._scan()[0] or self._form_quietly() is not None:
            return None
        last = self.queue.last
        return {"logs": stats, "queued_groups": self.queue.groups,
                "queued_sequences": sum(self.queue.lane_sequences.values()),
                "last": [last.source, last.row] if last is not None else self._handed.get("last")}

    def _form_quietly(self) -> list[Entry] | None:
        """Whether a batch could be formed now, without taking it."""
        if self.registration is None or not self.queue.groups:
            return None
        return self._form()

    def note_busy(self) -> None:
        """The service has work (a post, a served batch, a commit, new shards): noted for `quiet`."""
        now = time.monotonic()
        self._busy_gaps.append(now - self.last_busy)
        self.last_busy = now

    def quiet(self, idle_s: float, longest_s: float) -> bool:
        """Whether the service has had no work for `idle_s`, and for longer than 4x the longest of its last 16
        pauses between work (up to `longest_s`: steady slow traffic is not a stop), and has none now: no post or
        commit in flight, no prefetched batch, no replay, no batch that could be formed."""
        if self.dormant or self._replay or self._prefetched is not None or self._inflight or self._stored_ids:
            return False
        if self.followed_logs is None:  # a new image could not start dormant: a recycle would give nothing back
            return False
        if time.monotonic() - self.last_busy < max(idle_s, min(longest_s, 4 * max(self._busy_gaps, default=0.0))):
            return False
        if self._prefetch_task is not None and not self._prefetch_task.done():
            return False
        if self.committer is not None and not self.committer.idle:
            return False
        if self._committer_ready is not None and not self._committer_ready.done():
            return False
        return self._form_quietly() is None

    async def wake(self) -> None:
        """Leave the dormant start: index the served state (importing pyarrow and the store in a thread, indexing on
        the event loop, as the queue is the loop's: a start's work, milliseconds here, seconds at a million shards)
        and follow the store, as a start that had shards would have."""
        if not self.dormant:
            return
        async with self._waking:
            if not self.dormant:
                return
            await asyncio.to_thread(lambda: self.store)
            with _bulk_load(self.sources):
                self._load_index()
            self.dormant = False
            self._add_shards(await asyncio.to_thread(self._scan))
            self._kick_prefetch()

    def _wake_soon(self) -> None:
        """Lane policies changed: a dormant service holding groups wakes (in a task), since the groups it holds
        may now make a batch."""
        if self.dormant and self._handed["queued_groups"]:
            # held: the loop keeps only a weak reference to a task
            self._wake_task = asyncio.get_running_loop().create_task(self.wake())

    def _load_index(self) -> None:
        """The indexed shards and compacted blocks: their files, and the queue of groups not taken yet."""
        if self.state.has_sources() and getattr(self.store, "where", None) is not None:
            self._fold()
        sources = self.state.sources()
        blocks = self.state.source_blocks()
        taken: TakenRows | None = None
        if sources or blocks:  # an idle service with nothing indexed does not load pyarrow and the store
            from factory.serve.follower import IndexCache, Locator, summaries_table

            taken = self.state.taken_rows()
            indexes, locator = IndexCache(filesystem=self.store.filesystem), Locator(self.store)
        ranges: list[tuple[Any, int, Any, int]] = []
        pending_blocks = iter(blocks)
        block = next(pending_blocks, None)
        summary = getattr(self.store, "index_summary", None) if blocks else None  # an idle service: no store loaded

        def add_blocks_before(source: int | None) -> None:
            """Blocks indexed before `source` (None: all that are left), in arrival order."""
            nonlocal block, ranges
            while block is not None and (source is None or block[0] < source):
                first_source, run_id, file, first, member_rows = block
                block = next(pending_blocks, None)
                path = self.store.shard_path(run_id, file)
                self._add_block(first_source, run_id, file, path, first, member_rows)
                try:
                    table = indexes.file(path, first, int(member_rows.sum()), summary(run_id, file) if summary else None)
                except OSError as error:
                    logger.error("indexed compacted file %s is gone or unreadable; its unserved groups are lost: %s", path, error)
                    continue
                if len(ranges) >= 50_000:
                    enqueue()
                ranges.append((table, first, member_rows, first_source))

        deferred: list[int] = []
        summaries: list[dict[str, Any]] = []

        def enqueue() -> None:
            """Queue `ranges`, the shards among them whose records carry their index given one table made from
            those summaries first (`follower.summaries_table`: their files are not opened)."""
            nonlocal ranges
            if deferred:
                table, starts = summaries_table(summaries, [rows_ if type(rows_) is int else int(rows_.sum()) for rows_
                                                            in (ranges[position][2] for position in deferred)])
                for position, at in zip(deferred, starts):
                    _, _, rows_, source_ = ranges[position]
                    ranges[position] = (table, at, rows_, source_)
                deferred.clear()
                summaries.clear()
            self._enqueue_ranges(ranges, taken)
            ranges = []

        own_file = locator.own_file if sources else None
        paths, source_ids, add_known = self.sources, self._source_ids, self._known.add
        count = taken.count if taken is not None and len(taken) else None
        # stretches of shards in their own files whose index is their record's summary (before compaction, every
        # shard): taken as columns, not one by one
        stretches = locator.own_stretches(sources) if sources and getattr(self.store, "current", None) else []
        if stretches:
            import numpy as np

            taken_ids = np.fromiter(taken._counts.keys(), dtype=np.int64) if count is not None else None
            taken_counts = np.fromiter(taken._counts.values(), dtype=np.int64) if count is not None else None
        stretch_at = {stretch.start: stretch for stretch in stretches}
        at, total = 0, len(sources)
        while at < total:
            stretch = stretch_at.get(at)
            if stretch is not None:
                first, length = stretch.first, stretch.stop - stretch.start
                if block is not None:
                    add_blocks_before(first)
                ids = range(first, first + length)
                keys = list(zip(repeat(stretch.run_id), stretch.shards))
                paths.update(zip(ids, stretch.paths))
                source_ids.update(zip(keys, ids))
                self._known.update(keys)
                cuts = [0, length]
                if taken_ids is not None:  # sources whose rows are all taken: none of theirs queued (as below)
                    low, high = np.searchsorted(taken_ids, [first, first + length])
                    within = taken_ids[low:high] - first
                    full = within[taken_counts[low:high] >= stretch.rows[within]].tolist()
                    cuts = [0] + [edge for position in full for edge in (position, position + 1)] + [length]
                for lo, hi in zip(cuts[::2], cuts[1::2]):
                    if hi > lo:
                        if len(ranges) >= 50_000:
                            enqueue()
                        deferred.append(len(ranges))
                        summaries.extend(stretch.summaries[lo:hi])
                        ranges.append((None, 0, stretch.rows[lo:hi], first + lo))
                at = stretch.stop
                continue
            source, run_id, shard, rows = sources[at]
            at += 1
            if block is not None:
                add_blocks_before(source)
            own = own_file(run_id, shard, rows)  # its index from its commit record, if it carries one
            if own is not None:
                path, offset = own[0], 0
            else:
                path, offset = locator.locate(run_id, shard)
            paths[source] = path
            key = (run_id, shard)
            source_ids[key] = source
            if offset:
                self.row_offsets[source] = offset
            add_known(key)
            if count is not None and count(source) >= rows:
                continue
            if own is not None:  # made with the others' at `enqueue`
                if len(ranges) >= 50_000:
                    enqueue()
                deferred.append(len(ranges))
                summaries.append(own[1])
                ranges.append((None, 0, rows, source))
                continue
            try:
                table = indexes.file(path, offset, rows)
            except OSError as error:
                logger.error("indexed shard %s is gone or unreadable; its %d unserved groups are lost: %s", path,
                             rows - (count(source) if count is not None else 0), error)
                continue
            if len(ranges) >= 50_000 and ranges[-1][0] is not table:  # the index columns are not all held at once
                enqueue()
            ranges.append((table, offset, rows, source))
        add_blocks_before(None)
        enqueue()
        logger.info("served state loaded: step %d, %d groups queued from %d shards and %d blocks of compacted files",
                    self.step, self.queue.groups, len(self.sources), len(self._block_firsts))

    def _fold(self) -> None:
        """Shards indexed one by one (as they were committed) that a compaction has since merged, in the same
        order, into one file: each run of consecutive source ids becomes one block of the served state (their ids
        and taken rows unchanged), so that this start-up is the last to look at them one by one. Works on columns
        (the served state's sources, each run's records looked up all at once): at a million shards a loop per
        source was most of a restart's time."""
        import numpy as np

        compacted = getattr(self.store, "compacted", None)
        current = getattr(self.store, "current", None)
        runs = self.state.source_runs()
        if compacted is not None and not any(compacted(run_id) for run_id in runs):
            return  # no run compacted: every shard in its own file, none to fold (no look each)
        columns = self.state.source_columns(runs) if current is not None else None
        if columns is None:  # a store without records to look up at once, or names the columns cannot carry
            ids, rows, run_codes, codes, firsts, file_names = self._locate_one_by_one(runs)
        else:
            ids, rows, run_codes = columns.ids, columns.rows, columns.run_codes.astype(np.int64)
            runs = columns.runs
            codes, firsts = np.full(len(ids), -1, np.int64), np.zeros(len(ids), np.int64)
            file_names = {}
            for run_code, run_id in enumerate(runs):
                if compacted is not None and not compacted(run_id):
                    continue
                members = np.flatnonzero(run_codes == run_code)
                names = columns.shards if len(members) == len(ids) else columns.shards.take(members)
                run_file_codes, run_files, run_firsts = current(run_id).locate(names)
                inside = run_file_codes >= 0
                base = len(file_names)  # a code per (run, file): two runs may name their merged files alike
                file_names.update({base + code: file for code, file in enumerate(run_files)})
                codes[members[inside]] = run_file_codes[inside] + base
                firsts[members] = run_firsts
        # a source continues the block before it where it is the next id, in the same merged file, and its
        # rows follow that source's rows there
        inside = codes >= 0
        follows = np.zeros(len(ids), dtype=bool)
        follows[1:] = (inside[1:] & inside[:-1] & (ids[1:] == ids[:-1] + 1) & (codes[1:] == codes[:-1])
                       & (firsts[1:] == firsts[:-1] + rows[:-1]))
        starts = np.flatnonzero(~follows)
        lengths = np.diff(np.append(starts, len(ids)))
        folded, in_blocks = [], np.zeros(len(ids), dtype=bool)
        for start, length in zip(starts.tolist(), lengths.tolist()):
            if inside[start] and length >= FOLD_MIN_SHARDS:
                folded.append((int(ids[start]), runs[int(run_codes[start])], file_names[int(codes[start])],
                               int(firsts[start]), rows[start:start + length].copy()))
                in_blocks[start:start + length] = True
        if not folded:
            return
        try:
            self.state.fold_sources(folded, kept=ids[~in_blocks])
        except sqlite3.Error as error:
            logger.error("cannot fold %d runs of compacted shards into blocks of the served state %s (%s); they are "
                         "loaded one by one", len(folded), self.state.path, error)
            return
        logger.info("folded %d compacted shards into %d blocks of the served state",
                    sum(len(f[4]) for f in folded), len(folded))

    def _locate_one_by_one(self, runs: list[str]) -> tuple[Any, ...]:
        """`_fold`'s columns made source by source (a store that cannot look names up at once)."""
        import numpy as np

        current = getattr(self.store, "current", None)
        snapshots: dict[str, Any] = {}

        def where(run_id: str, shard: str) -> tuple[str, int] | None:
            if current is None:
                return self.store.where(run_id, shard)
            records = snapshots.get(run_id)
            if records is None:  # one snapshot of each run's records, not a look at its log (a stat) per source
                records = snapshots[run_id] = current(run_id)
            return records.where(shard)

        sources = self.state.sources()
        run_index = {run_id: code for code, run_id in enumerate(runs)}
        files: dict[tuple[str, str], int] = {}
        codes, firsts = [], []
        for _, run_id, shard, _ in sources:
            found = where(run_id, shard)
            inside = found is not None and found[0] != shard  # (not committed, or in its own file: no block)
            codes.append(files.setdefault((run_id, found[0]), len(files)) if inside else -1)
            firsts.append(found[1] if inside else 0)
        return (np.array([s[0] for s in sources], dtype=np.int64), np.array([s[3] for s in sources], dtype=np.int64),
                np.array([run_index[s[1]] for s in sources], dtype=np.int64), np.array(codes, dtype=np.int64),
                np.array(firsts, dtype=np.int64), {code: file for (_, file), code in files.items()})

    async def start(self) -> None:
        limit_malloc_arenas()  # before the first worker thread allocates (pyarrow's pool is set when it is loaded)
        self._running = True
        if not self.dormant and self._may_have_shards():
            with _bulk_load(self.sources):
                self._add_shards(await asyncio.to_thread(self._scan))
            await self.ready_for_posts()
        self._follow_task = asyncio.create_task(self._follow(), name="store-follower")

    async def stop(self) -> None:
        if self._committer_ready is not None and not self._committer_ready.done():
            await asyncio.wait([self._committer_ready])
        self._running = False
        if self.committer is not None:
            await self.committer.stop()
        for task in (self._follow_task, self._prefetch_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                    pass
        self._release_prefetch()
        if self.recycling:
            try:
                self.handover = self._handover() if not self.dormant else self._handed
            except Exception:  # noqa: BLE001 - the next image then starts as any start does
                logger.exception("cannot tell the next image what it may stay dormant on; it indexes at its start")
                self.handover = None
        self.final_status = self.status()
        self.state.close()

    # ---- sources of groups ----
    def _scan(self) -> tuple[list[NewShard | NewBlock], list[Moved]]:
        if not self._may_have_shards():
            return [], []
        from factory.serve.follower import runs_to_follow, scan_new_shards

        runs = runs_to_follow(self.store, self.config.follow_runs, self.config.ingest_run)
        moved: list[Moved] = []
        blocks = {key: list(spans) for key, spans in self._block_ranges.items()}
        return scan_new_shards(self.store, runs, set(self._known), self._reported, moved, blocks, together=True), moved

    def _add_block(self, first_source: int, run_id: str, file: str, path: Path | str, first: int, member_rows: Any) -> None:
        """Note an indexed block of a compacted file's members: source `first_source + i` is member i."""
        import numpy as np

        ends = np.cumsum(member_rows)
        self._block_firsts.append(first_source)
        self._block_places.append((path, first + ends - member_rows))
        self._block_ranges.setdefault((run_id, file), []).append((first, first + (int(ends[-1]) if len(ends) else 0)))

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.config.follow_interval_s)
            try:
                if self.dormant:
                    if not self._logs_moved():
                        continue
                    await self.wake()
                    continue
                self._add_shards(await asyncio.to_thread(self._scan))
            except Exception:  # noqa: BLE001 - a bad scan must not stop following; it is retried next interval
                logger.exception("scan of followed runs failed; retrying in %.1f s", self.config.follow_interval_s)

    def _add_shards(self, found: tuple[list[NewShard | NewBlock], list[Moved]]) -> None:
        shards, moved = found
        self._relocate(moved)
        if not shards:
            return
        self.note_busy()
        # not before: an idle service has not loaded the store
        from factory.serve.follower import NewBlock, NewShards, covered
        from factory.serve.state import BlockRows, ShardRows

        new: list[NewShard | NewBlock] = []
        keys: list[tuple[str, str]] = []
        ids_of: list[list[str]] = []
        entries: list[tuple[str, str, Any, list[str]]] = []
        """What the served state indexes, entry by entry: (run, shard or file, rows or BlockRows, group ids)."""
        id_files: dict[Path | str, list[str]] = {}
        seen: set[tuple[str, str]] = set()
        known_keys, ingest_run, no_ids = self._known, self.config.ingest_run, []

        def one_by_one(shards: list[Any]) -> Iterator[Any]:
            """`NewShards` whole where none of its members is known or met before in this scan (nor of the ingest
            run, whose group ids are read shard by shard), else as a `NewShard` each."""
            for shard in shards:
                if type(shard) is not NewShards:
                    yield shard
                    continue
                members = list(zip(repeat(shard.run_id), shard.shards))
                if shard.run_id == ingest_run or not known_keys.isdisjoint(members) or not seen.isdisjoint(members):
                    yield from shard.members()
                    continue
                shard.keys = members
                yield shard

        for shard in one_by_one(shards):
            run_id = shard.run_id
            if type(shard) is NewShards:
                seen.update(shard.keys)
                new.append(shard)
                keys.append(None)
                ids_of.append(no_ids)
                entries.append((run_id, "", ShardRows(shard.shards, shard.rows.tolist()), no_ids))
                continue
            if type(shard) is NewBlock:
                key = (run_id, f"\x00{shard.file}\x00{shard.first}")
                known = covered(self._block_ranges, run_id, shard.file, shard.first, shard.first + shard.rows)
                if known is None:  # the follower splits such blocks into their members; not one it was given
                    logger.error("rows %d..%d of %s/%s are in part indexed already; left out of this scan",
                                 shard.first, shard.first + shard.rows, run_id, shard.file)
                if known is not False:
                    continue
            else:
                key = (run_id, shard.shard)
                if key in known_keys:
                    continue
            if key in seen:
                continue
            seen.add(key)
            ids: list[str] = no_ids
            if run_id == ingest_run:
                # Committed while the state DB could not note it, or by a service that died before it could.
                ids = self._group_ids(shard, id_files)
                self._stored_ids.update(ids)
            new.append(shard)
            keys.append(key)
            ids_of.append(ids)
            entries.append((run_id, shard.file, BlockRows(shard.first, shard.member_rows), ids) if type(shard) is NewBlock
                           else (run_id, shard.shard, shard.rows, ids))
        if not new:
            return
        try:  # one transaction for the whole scan: all of it is indexed, or none and the next scan retries it
            sources = self.state.add_sources(entries)
        except sqlite3.Error as error:
            logger.error("cannot index %d shards in the served state %s (%s); retrying at the next scan", len(new), self.state.path, error)
            return
        ranges: list[tuple[Any, int, Any, int]] = []
        add_range, paths, source_ids, add_known = ranges.append, self.sources, self._source_ids, known_keys.add
        for shard, key, ids, source in zip(new, keys, ids_of, sources):
            if ids:
                self._stored_ids.difference_update(ids)
            if type(shard) is NewShards:  # source: their ids, in order
                paths.update(zip(source, shard.paths))
                source_ids.update(zip(shard.keys, source))
                known_keys.update(shard.keys)
                if type(source) is range:  # consecutive: one range of the queueing (as a block's)
                    add_range((shard.file_index, shard.index_offset, shard.rows, source.start))
                    continue
                at = shard.index_offset
                for rows, one in zip(shard.rows.tolist(), source):
                    add_range((shard.file_index, at, rows, one))
                    at += rows
                continue
            if type(shard) is NewBlock:
                self._add_block(source, shard.run_id, shard.file, shard.path, shard.first, shard.member_rows)
                add_range((shard.file_index, shard.first, shard.member_rows, source))
                continue
            offset = shard.row_offset
            at = shard.index_offset
            add_range((shard.file_index, offset if at is None else at, shard.rows, source))
            paths[source] = shard.path
            source_ids[key] = source
            if offset:
                self.row_offsets[source] = offset
            add_known(key)
        self._enqueue_ranges(ranges)
        self._kick_prefetch()

    def _group_ids(self, shard: NewShard | NewBlock, files: dict[Path | str, list[str]]) -> list[str]:
        """group_ids of a shard's (or block's) rows; a merged file's column is read once for all its members (`files`)."""
        import pyarrow.parquet as pq

        offset = shard.first if hasattr(shard, "first") else shard.row_offset
        ids = files.get(shard.path)
        if ids is None:
            with pq.ParquetFile(shard.path, filesystem=self.store.filesystem) as parquet:
                ids = parquet.read(columns=["group_id"]).column(0).to_pylist()
            if offset or len(ids) != shard.rows:
                files.clear()  # one merged file at a time: its members come one after the other
                files[shard.path] = ids
        return ids[offset:offset + shard.rows]

    def _enqueue_ranges(self, ranges: list[tuple[Any, int, Any, int]], taken: TakenRows | None = None) -> None:
        """Queue the groups of sources, each (index columns of its file, first row in it, rows, source), in the
        order given; `taken`: rows already served or skipped, left out. All of them with one set of
        array operations: consecutive sources that are consecutive rows of one file (a compacted file's members)
        take one slice of its index, and the slices are concatenated (a shard's own file is its whole table).
        A block of a compacted file's members is one entry: its rows are a numpy array (rows of each member) and
        its source the first member's (member i is source + i)."""
        if not ranges:
            return
        import numpy as np
        import pyarrow as pa

        count_parts, id_parts, totals = [], [], []
        single_counts: list[int] = []
        single_ids: list[int] = []
        for _, _, rows_, source in ranges:
            if isinstance(rows_, (int, np.integer)):
                single_counts.append(rows_)
                single_ids.append(source)
                totals.append(rows_)
                continue
            if single_counts:
                count_parts.append(np.array(single_counts, dtype=np.int64))
                id_parts.append(np.array(single_ids, dtype=np.int64))
                single_counts, single_ids = [], []
            count_parts.append(np.asarray(rows_, dtype=np.int64))
            id_parts.append(np.arange(source, source + len(rows_), dtype=np.int64))
            totals.append(int(count_parts[-1].sum()))
        if single_counts:
            count_parts.append(np.array(single_counts, dtype=np.int64))
            id_parts.append(np.array(single_ids, dtype=np.int64))
        counts = count_parts[0] if len(count_parts) == 1 else np.concatenate(count_parts)
        ids = id_parts[0] if len(id_parts) == 1 else np.concatenate(id_parts)
        starts = np.cumsum(counts) - counts
        total = int(counts.sum())
        # 32-bit as the queue keeps them (no widening copy of every group's source and row); int64 arithmetic
        # only for a call of 2**31 groups or more
        wide = np.int64 if total >= 1 << 31 else np.int32
        sources = np.repeat(ids.astype(np.int32), counts)
        rows = np.arange(total, dtype=wide)
        rows -= np.repeat(starts.astype(wide), counts)
        drop = _taken_positions(taken, ids, starts, counts) if taken is not None else None
        slices = []
        at = 0
        while at < len(ranges):
            table, first, _, _ = ranges[at]
            upto = first
            while at < len(ranges) and ranges[at][0] is table and ranges[at][1] == upto:
                upto += totals[at]
                at += 1
            slices.append(table if first == 0 and upto == table.num_rows else table.slice(first, upto - first))
        if len({part.schema.field("env").type for part in slices}) > 1:  # files with a summary among others
            from factory.index_runs import plain

            slices = [plain(part) for part in slices]
        try:
            index = slices[0] if len(slices) == 1 else pa.concat_tables(slices, promote_options="permissive")
        except pa.ArrowException:  # files whose index columns cannot be put in one table: each on its own
            at = 0
            for part in slices:
                end = at + part.num_rows
                part_drop = None if drop is None else drop[(drop >= at) & (drop < end)] - at
                self._enqueue_rows(part, sources[at:end], rows[at:end],
                                   part_drop if part_drop is not None and len(part_drop) else None)
                at = end
            return
        self._enqueue_rows(index, sources, rows, drop)

    def _relocate(self, moved: list[Moved]) -> None:
        """Read shards a compaction merged while the service runs from the merged file: same rows, same (shard,
        row) keys in the served state, so nothing is served twice or skipped (the member files may be gone)."""
        for shard in moved:
            source = self._source_ids.get((shard.run_id, shard.shard))
            if source is None or self._location(source, 0) == (shard.path, shard.row_offset):
                continue
            self._moved[source] = (shard.path, shard.row_offset)
            logger.info("shard %s/%s is now read from %s (compacted)", shard.run_id, shard.shard, shard.path)

    def _enqueue_rows(self, index: Any, sources: Any, rows: Any, drop: Any = None) -> None:
        """Queue the groups of `index` (INDEX_COLUMNS, one row per group, in arrival order): group i is row
        `rows[i]` of source `sources[i]`; `drop` (ascending positions), if given, leaves those out (already
        taken). One block per lane, not a Python object per group (see queue.py); with `drop`, one per lane and
        stretch of `_spans`: only the stretches around taken groups are copied without them."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        if not index.num_rows:
            return
        env_ids = index.column("env_id")
        with_id = None
        if env_ids.null_count < len(env_ids):
            values = pc.unique(env_ids).drop_null()
            codes = _ints(pc.index_in(env_ids, value_set=values), null=-1)
            table = np.array([self.queue.lane(("id", value)) for value in values.to_pylist()] + [-1], dtype=np.int32)
            lanes = table[codes]
            with_id = codes >= 0
        if with_id is None or not with_id.all():
            env = index.column("env")
            if not pa.types.is_dictionary(env.type):  # strings (read from Parquet): one encoding, one chunk
                env = pa.chunked_array([pc.dictionary_encode(env).combine_chunks()])
            parts = []
            for chunk in env.chunks:  # codes into each chunk's names (a file's summary's, see index_runs.table_of)
                names = chunk.dictionary.to_pylist()
                table = np.array([self.queue.lane(("name", name)) for name in names] + [-1], dtype=np.int32)
                parts.append(table[_ints(chunk.indices, null=-1)])
            by_name = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if with_id is None:
                lanes = by_name
            else:
                lanes[~with_id] = by_name[~with_id]
        sizes = _ints(index.column("group_size"))
        versions = _int64s(index.column("policy_version"))
        if drop is None:
            self.queue.add_many(sources, rows, sizes, lanes, versions)
            return
        for lo, hi, out in _spans(drop, len(sources)):
            if out is None:
                self.queue.add_many(sources[lo:hi], rows[lo:hi], sizes[lo:hi], lanes[lo:hi], versions[lo:hi])
                continue
            keep = np.ones(hi - lo, dtype=bool)
            keep[out - lo] = False
            self.queue.add_many(sources[lo:hi][keep], rows[lo:hi][keep], sizes[lo:hi][keep], lanes[lo:hi][keep],
                                versions[lo:hi][keep])

    def _on_commit(self, record: CommitRecord, rows: pa.Table) -> None:
        self.note_busy()
        if (record.run_id, record.shard) in self._known:  # the follower's scan saw the commit log first
            self._count_ingested(rows.column("env").to_pylist())
            return
        columns = rows.select(["group_id", "group_size", "env", "env_id", "policy_version"]).to_pydict()
        ids = columns["group_id"]
        self._stored_ids.update(ids)  # the commit is durable: from here on a retry of these ids stores nothing
        try:
            source = self.state.add_source(record.run_id, record.shard, record.rows, ids)
        except sqlite3.Error as error:
            # The groups are stored (the commit log is the record of it) and are acknowledged; the follower
            # indexes the shard once the state DB can be written again.
            logger.error("shard %s is committed but the served state %s could not index it (%s); it is queued at a later scan",
                         record.shard, self.state.path, error)
            return
        self._stored_ids.difference_update(ids)
        path = self.store.shard_path(record.run_id, record.shard)
        if self.store.file_size(path) is None:  # committed, but its rename into place failed: finish it (reads fail until then)
            self.store.finish_commits(record.run_id)
        self.sources[source] = path
        self._source_ids[(record.run_id, record.shard)] = source
        self._known.add((record.run_id, record.shard))
        for row, (size, env, env_id, version) in enumerate(
            zip(columns["group_size"], columns["env"], columns["env_id"], columns["policy_version"])
        ):
            key = ("id", env_id) if env_id is not None else ("name", env)
            self.queue.add(source, row, size, self.queue.lane(key), version)
        self._count_ingested(columns["env"])
        self._kick_prefetch()

    def _count_ingested(self, envs: list[str]) -> None:
        self.ingested.update(envs)
        self.state.put(ingested=dict(self.ingested))

    def env_name(self, env_id: int | None) -> str:
        """The name rows of a posted group get when it names no env: its registered env's, else 'external'
        (any thread: called while bodies are decoded)."""
        env = self.envs[env_id] if env_id is not None and 0 <= env_id < len(self.envs) else None
        return env["desired_name"] if env else "external"

    async def ingest(self, groups: list[ScoredGroup]) -> int:
        """Stamp validated groups with factory metadata and return once they are committed to a shard.

        Deduplicated by `group_id` only (ids already stored are acknowledged
        without storing them again); returns how many were new.
        """
        from factory.schema import groups_to_record_batch

        await self.ready_for_posts()
        fresh, future, mine = self._claim([group.group_id for group in groups])
        groups = [group for group, new in zip(groups, fresh) if new is None]
        for group in groups:
            if not group.env:
                group.env = self.env_name(group.env_id)
            group.run_id = self.config.ingest_run
            if "policy_version" not in group.model_fields_set:
                group.policy_version = self.step
        ids = [group.group_id for group in groups]
        await self._submit(future, mine, lambda: groups_to_record_batch(groups) if groups else None, fresh)
        return len(groups)

    def arriving(self) -> Any:
        """Context of a post whose body is being decoded: the next commit lingers for it (see ingest.py)."""
        if self.committer is None:
            return contextlib.nullcontext(None)
        return self.committer.arriving()

    def announce(self, arrival: Arrival | None) -> None:
        """The post of `arrival` started decoding (called from the decoding thread)."""
        if arrival is not None and self.committer is not None:
            self.committer.announce(arrival)

    async def ingest_wire(self, parsed: WireGroups, arrival: Arrival | None = None) -> int:
        """Store posted groups (decoded by `wire.decode_groups`) and return once they are committed.

        Only groups with a client-given identity (group_id or Idempotency-Key)
        can be recognised as already stored; the rest are always stored.
        Returns how many were stored by this call.
        """
        from factory.serve.wire import stamp, to_record_batch

        await self.ready_for_posts()
        claims, future, mine = self._claim([i if known else None for i, known in zip(parsed.ids, parsed.identified)])
        keep = [index for index, claim in enumerate(claims) if claim is None]
        envs = [parsed.envs[i] or self.env_name(parsed.env_ids[i]) for i in keep]
        step = self.step
        versions = [parsed.versions[i] if parsed.versions[i] is not None else step for i in keep]
        unaligned = Counter(name for i in keep for name in parsed.unaligned_by_group[i])
        prebuilt = parsed.rows is not None
        if prebuilt:
            rows = parsed.rows
            parsed.rows = None
            final = parsed.resolved and len(keep) == rows.num_rows  # built in the decoding thread as they are stored

            def build() -> pa.RecordBatch | None:
                if final:
                    return rows
                return stamp(rows, keep, envs, versions) if keep else None
        else:
            box = [[parsed.groups[i] for i in keep]]
            ids = [parsed.ids[i] for i in keep]
            parsed.groups = []  # only `box` holds the decoded groups now: freed as soon as they are Arrow rows

            def build() -> pa.RecordBatch | None:
                decoded = box.pop()
                if not decoded:
                    return None
                return to_record_batch(decoded, ids, run_id=self.config.ingest_run, envs=envs, versions=versions)

        # Stamping rows already built is a column swap: not worth a thread hop. Building from decoded groups is.
        await self._submit(future, mine, build, claims, arrival, in_thread=not prebuilt)
        if unaligned:
            self.unaligned.update(unaligned)
            try:
                self.state.put(unaligned=dict(self.unaligned))
            except sqlite3.Error as error:  # the groups are stored: a failed counter must not fail the post
                logger.warning("cannot save the unaligned-field counts to %s: %s", self.state.path, error)
        return len(keep)

    def _claim(self, ids: list[str | None]) -> tuple[list[Any], asyncio.Future[None], set[str]]:
        """Claim ids for this request: per id None (this request stores it), True (already stored) or the
        future of the in-flight commit that stores it; plus this request's future and claimed ids."""
        named = [i for i in ids if i is not None]
        known = self.state.known_group_ids(named) if named else set()
        if self._stored_ids:
            known.update(i for i in named if i in self._stored_ids)
        claims: list[asyncio.Future[None] | bool | None] = []
        mine: set[str] = set()
        for group_id in ids:
            if group_id is None:
                claims.append(None)
            elif group_id in known or group_id in mine:
                claims.append(True)
            elif group_id in self._inflight:
                claims.append(self._inflight[group_id])
            else:
                mine.add(group_id)
                claims.append(None)
        duplicates = sum(1 for c in claims if c is not None)
        if duplicates:
            logger.info("%d posted groups were already stored or in flight; acknowledged without storing again", duplicates)
        future = asyncio.get_running_loop().create_future()
        for group_id in mine:
            self._inflight[group_id] = future
        return claims, future, mine

    async def _submit(
        self, future: asyncio.Future[None], mine: set[str], build: Any, claims: list[Any], arrival: Arrival | None = None,
        *, in_thread: bool = True,
    ) -> None:
        """Build this request's rows (in a thread), commit them, then wait for in-flight commits of its duplicates."""
        try:
            if self.committer is None:
                raise RuntimeError("the service is not started")
            rows = await asyncio.to_thread(build) if in_thread else build()
            if rows is not None:
                await self.committer.submit(rows, arrival)
            if not future.done():
                future.set_result(None)
        except BaseException as error:
            if not future.done():
                future.set_exception(error if isinstance(error, Exception) else RuntimeError("cancelled"))
                future.exception()  # retrieved: other waiters re-raise it themselves
            raise
        finally:
            for group_id in mine:
                if self._inflight.get(group_id) is future:
                    del self._inflight[group_id]
        for other in claims:
            if isinstance(other, asyncio.Future):
                await asyncio.shield(other)

    # ---- trainer and env registration ----
    async def register(self, registration: dict[str, Any]) -> dict[str, Any]:
        if self.dormant and self._handed["queued_groups"]:
            await self.wake()  # a new batch size may make a batch of the groups the dormant image holds
        async with self._lock:
            self._release_prefetch()
            start = registration["starting_step"]
            if self.registration is not None and start < self.step:
                until = max(self.step, self.state.get("replay_until", 0))
                self._replay = deque(b for b in self.state.batches_from(start) if b[0] < until)
                self.state.put(replay_until=until)
                logger.info("trainer resumes at step %d: replaying %d served batches", start, len(self._replay))
                self.step = start
            elif self.registration is None or start > self.step:
                self.step = start
                self._replay.clear()
            self.registration = registration
            self.state.put(registration=registration, step=self.step)
        self.requesters.append(uuid.uuid4().int)
        return {"uuid": self.requesters[-1]}

    def register_env(self, request: dict[str, Any]) -> dict[str, Any]:
        if not self.started:
            return {"status": "wait for trainer to start"}
        name = request["desired_name"]
        real_name = f"{name}_{sum(1 for env in self.envs if env['desired_name'] == name)}"
        env = {
            "max_context_len": request["max_token_length"],
            "weight": request["weight"] if request.get("weight") is not None else 1.0,
            "desired_name": name,
            "real_name": real_name,
            "registered_id": len(self.envs),
            "last_update": time.time(),
            "connected": True,
            "min_batch_allocation": request.get("min_batch_allocation"),
            "group_size": request["group_size"],
        }
        self.envs.append(env)
        self.state.put_env(env)
        self._wake_soon()
        registration = self.registration or {}
        return {
            "status": "success",
            "env_id": env["registered_id"],
            "wandb_name": real_name,
            "checkpoint_dir": registration.get("checkpoint_dir", ""),
            "starting_step": self.step,
            "checkpoint_interval": registration.get("save_checkpoint_interval", -1),
            "num_steps": registration.get("num_steps", -1),
        }

    def disconnect_env(self, env_id: int) -> dict[str, Any]:
        if not 0 <= env_id < len(self.envs):
            return {"status": "failure", "error": f"env_id {env_id} is not registered ({len(self.envs)} envs are)"}
        self.envs[env_id]["connected"] = False
        self.state.put_env(self.envs[env_id])
        self._wake_soon()
        return {"status": "success"}

    # ---- status ----
    def info(self) -> dict[str, Any]:
        if self.registration is None:
            return {"batch_size": -1, "max_token_len": -1}
        return {"batch_size": self.registration["batch_size"], "max_token_len": self.registration["max_token_len"]}

    def wandb_info(self) -> dict[str, Any]:
        if self.registration is None:
            return {"group": None, "project": None}
        return {"group": self.registration["wandb_group"], "project": self.registration["wandb_project"]}

    def status(self) -> dict[str, Any]:
        return {
            "current_step": self.step,
            "queue_size": self._handed["queued_groups"] if self.dormant else self.queue.groups,
            "queued_sequences": self._handed["queued_sequences"] if self.dormant else sum(self.queue.lane_sequences.values()),
            "served_groups": self.state.served_groups(),
            "skipped_stale": self.skipped_stale,
            "skipped_oversize": self.skipped_oversize,
            # Groups stored with a field whose lengths don't line up with tokens (Atropos stores them as sent).
            "unaligned": {name: self.unaligned.get(name, 0) for name in SEQUENCE_FIELDS},
            # Posted groups committed to the store so far, by env name (the env's desired_name).
            "ingested": dict(self.ingested),
            **({"ingest": self.ingest_budget.status()} if self.ingest_budget is not None else {}),
        }

    def lane_policies(self) -> dict[int, LanePolicy]:
        policies = {}
        for lane, key in enumerate(self.queue.lane_key_of):
            kind, value = key
            if kind == "id":
                env = self.envs[value] if isinstance(value, int) and 0 <= value < len(self.envs) else None
                policies[lane] = (
                    LanePolicy(env["weight"], env.get("min_batch_allocation"), env.get("connected", True)) if env else LanePolicy()
                )
            else:
                policies[lane] = LanePolicy(
                    self.config.env_weights.get(value, 1.0), self.config.env_min_batch_allocation.get(value)
                )
        return policies

    def status_env(self, env_id: int) -> dict[str, Any] | None:
        """Atropos's /status-env numbers for one env (None if the env is not registered)."""
        if not 0 <= env_id < len(self.envs):
            return None
        env = self.envs[env_id]
        connected = [e for e in self.envs if e.get("connected")]
        total = sum(e["max_context_len"] * max(0.0, e["weight"]) for e in connected)
        weight = env["max_context_len"] * env["weight"] / total if total > 0 else MIN_ENV_WEIGHT
        batch_size = self.registration["batch_size"] if self.registration else 0
        policies = self.lane_policies()
        min_total = sum(e["min_batch_allocation"] for e in connected if e.get("min_batch_allocation") is not None)
        min_total += sum(self.config.env_min_batch_allocation.values())
        own_lane = self.queue.lane(("id", env_id))
        max_group = self.queue.max_group_size()
        group_size = max(1, env["group_size"])
        own = self.queue.lane_sequences[own_lane]
        available = 0
        for lane in self.queue.lanes():
            if lane == own_lane:
                continue
            packed = math.ceil(self.queue.lane_sequences[lane] / max_group) * max_group
            policy = policies.get(lane, LanePolicy())
            minimum = int(batch_size * policy.min_fraction) if policy.active and policy.min_fraction else 0
            available += max(0, packed - minimum)
        return {
            "current_step": self.step,
            "queue_size": (own + available) // group_size,
            "unallocated_fraction": 1.0 - min(min_total, 1.0),
            "self_queue_size": own // group_size,
            "max_group_size": max_group,
            "env_weight": max(MIN_ENV_WEIGHT, weight),
        }

    # ---- batches ----
    def _form(self) -> list[Entry] | None:
        batch_size = self.registration["batch_size"]
        lag = self.config.max_policy_lag
        floor = self.step - lag if lag is not None else None
        newest_first = self.config.batch_order == "newest_first"
        while True:
            queues: dict[int, list[Entry]] = {}
            stale: list[Entry] = []
            oversize: list[Entry] = []
            for lane in self.queue.lanes():
                usable = []
                for entry in self.queue.prefix(lane, 4 * batch_size, newest_first):
                    if entry.size > batch_size:
                        oversize.append(entry)
                    elif floor is not None and entry.version < floor:
                        stale.append(entry)
                    else:
                        usable.append(entry)
                queues[lane] = usable
            if not stale and not oversize:
                return pack_batch(queues, batch_size, self.lane_policies(), newest_first)
            for entries, step in ((stale, SKIPPED_STALE), (oversize, SKIPPED_OVERSIZE)):
                if entries:
                    self.state.record_taken([(e.source, e.row) for e in entries], step)
                    self.queue.remove(entries)
            self.skipped_stale += len(stale)
            self.skipped_oversize += len(oversize)
            if stale:
                logger.warning("skipped %d groups more than %d policy versions behind step %d", len(stale), lag, self.step)
            if oversize:
                logger.warning("skipped %d groups larger than batch_size %d", len(oversize), batch_size)

    def _table(self, keys: list[tuple[int, int]]) -> pa.Table:
        return self.reader.read([self._location(source, row) for source, row in keys])

    def _encode(self, body: BatchBody, arrow: bool, compress: bool, table: pa.Table | None = None) -> BatchBody:
        """Make the encoding asked for, if `body` has not got it yet (in a thread), from `table` or its rows read
        again."""
        from factory.serve.payload import batch_arrow, batch_rows, encode_batch, gzip_batch, json_batch

        if arrow:
            if body.arrow is None:
                body.arrow = batch_arrow(table if table is not None else self._table(body.keys), compress=compress)
            return body
        if body.ready(False, compress):
            return body
        if table is None:
            table = self._table(body.keys)
        level = self.config.gzip_level
        if compress and level and table.nbytes >= 8 * self.config.gzip_min_bytes:
            # Surely over gzip_min_bytes as JSON (a number's text is at least a quarter of its Arrow bytes): gzip made
            # while encoding, so the JSON body is never whole beside its gzip and the rows.
            rows = batch_rows(table, metadata=self.config.batch_metadata)
            table = None  # the rows hold what they need; each is let go once compressed
            body.gz = gzip_batch(rows, gzip_compressor(level))
            return body
        if not compress:
            # In chunks, so the event loop runs between them (`json_batch`); each row let go once written.
            rows = batch_rows(table, metadata=self.config.batch_metadata)
            table = None
            body.raw = json_batch(rows)
            return body
        body.raw = encode_batch(table, metadata=self.config.batch_metadata)  # small, for a gzip client
        table = None  # the rows are not needed for the gzip: not held beside it
        if level and len(body.raw) >= self.config.gzip_min_bytes:
            # A gzip client gets the gzip only: not keeping the JSON as well lowers what a prefetched body and the
            # one being sent hold (~2.3x less at gzip level 1); a client that does not take gzip has it made again.
            body.gz, body.raw = gzip_compress(body.raw, level), None
        return body

    def _location(self, source: int, row: int) -> tuple[Path | str, int]:
        """(file, row in it) of a queued group."""
        moved = self._moved.get(source)
        if moved is not None:
            return moved[0], moved[1] + row
        path = self.sources.get(source)
        if path is not None:
            return path, row + self.row_offsets.get(source, 0)
        at = bisect.bisect_right(self._block_firsts, source) - 1
        if at < 0 or source - self._block_firsts[at] >= len(self._block_places[at][1]):
            raise KeyError(f"source {source} is not indexed")
        path, starts = self._block_places[at]
        return path, int(starts[source - self._block_firsts[at]]) + row

    def _read(self, keys: list[tuple[int, int]], arrow: bool, compress: bool) -> BatchBody:
        body = self._encode(BatchBody(keys=keys), arrow, compress, self._table(keys))
        # Reading and encoding a batch frees ~2-3x the body's size in pieces between live blocks, which malloc
        # keeps resident; trimming after each batch (~1 ms of CPU vs ~75 ms for the batch) keeps the drain's RSS
        # at what it holds instead of growing with fragments (bench.serve.drain_rss).
        return_free_memory()
        return body

    async def next_batch(self, accept_gzip: bool, arrow: bool = False) -> BatchBody:
        """The next batch for the trainer, recorded as served (durably) before it is returned.

        `arrow` asks for the rows as an Arrow IPC stream (`body.arrow`) instead of JSON (`body.raw`); bodies
        without rows are JSON either way. The next batch is prefetched in the format this call asked for.
        """
        if self.dormant and self._replay:
            await self.wake()
        async with self._lock:
            self._wanted = (arrow, accept_gzip)
            if self.registration is None:
                return BatchBody(NOT_REGISTERED)
            if not self.started:
                self.state.put(started=True)
                self.started = True
            if self._replay:
                step, keys = self._replay[0]
                body = await asyncio.to_thread(self._read, keys, arrow, accept_gzip)
                self.state.put(step=step + 1)
                self._replay.popleft()
                self.step = step + 1
                return body
            if self._prefetched is not None:
                entries, body = self._prefetched
                self._prefetched = None
                if not body.ready(arrow, accept_gzip):  # prefetched for a client that asked the other format
                    try:
                        body = await asyncio.to_thread(self._encode, body, arrow, accept_gzip)
                    except Exception:
                        self.queue.release(entries)
                        raise
            else:
                for attempt in range(UNREADABLE_RETRIES + 1):
                    entries = self._form()
                    if entries is None:
                        self._drop_cache()
                        return BatchBody(NO_BATCH)
                    self.queue.reserve(entries)
                    try:
                        body = await asyncio.to_thread(self._read, [(e.source, e.row) for e in entries], arrow, accept_gzip)
                        break
                    except PayloadError as error:
                        self.queue.release(entries)
                        if attempt == UNREADABLE_RETRIES or not self._leave_out_unreadable(entries, error):
                            raise
                    except Exception:
                        self.queue.release(entries)
                        raise
            try:
                self.state.record_taken([(e.source, e.row) for e in entries], self.step, kv={"step": self.step + 1})
            except BaseException:
                # Not recorded as served, so not served: the groups go back to the queue for the next /batch.
                self.queue.release(entries)
                raise
            self.queue.remove(entries)
            self.step += 1
            self.note_busy()
            size = len(body.arrow if arrow else body.raw if body.raw is not None else body.gz)
            logger.debug("served step %d: %d groups, %d bytes (%s)", self.step - 1, len(entries), size, "Arrow" if arrow else "JSON")
        if self.config.prefetch:
            self._prefetch_task = asyncio.create_task(self._prefetch())
        return body

    async def _prefetch(self) -> None:
        async with self._lock:
            if self._prefetched is not None or self._replay or self.registration is None:
                return
            entries = self._form()
            if entries is None:
                self._drop_cache(trim=False)
                return
            self.queue.reserve(entries)
            try:
                body = await asyncio.to_thread(self._read, [(e.source, e.row) for e in entries], *self._wanted)
            except Exception as error:  # noqa: BLE001 - the next /batch forms it again and reports the error
                self.queue.release(entries)
                if not (isinstance(error, PayloadError) and self._leave_out_unreadable(entries, error)):
                    logger.exception("prefetching the next batch failed")
                return
            self._prefetched = (entries, body)

    def _leave_out_unreadable(self, entries: list[Any], error: PayloadError) -> bool:
        """A batch could not be read because one file that is there cannot (`error.path`: damaged): its groups in
        `entries` leave the queue, unserved and not recorded as served (a restart queues them again, and they are
        served then if the file was repaired); the batch is formed again without them. The scan no longer opens a
        shard whose commit record carries its index (factory/index_runs.py), so a damaged one is found here, when
        its rows are read. Returns whether any entry was left out."""
        path = getattr(error, "path", None)
        if path is None or self.store.file_size(path) is None:
            # gone, not damaged: a compaction that removed its members before this service's next scan moves their
            # rows (`_relocate`), so the batch fails (503) and is formed again later, as before
            return False
        bad = [e for e in entries if str(self._location(e.source, e.row)[0]) == str(path)]
        if not bad:
            return False
        self.queue.remove(bad)
        if str(path) not in self._unreadable:  # once per file (each batch that meets its groups leaves out those)
            self._unreadable.add(str(path))
            logger.error("groups of %s left out of serving (not recorded as served; a restart tries them again): %s",
                         path, error)
        return True

    def _drop_cache(self, trim: bool = True) -> None:
        """No batch can be formed (the queue is empty, or holds less than a batch): the cached row groups would be
        read again only after more groups arrive, so drop them, and (`trim`) give the freed heap back to the OS;
        RSS then goes back towards idle instead of staying at the drain's peak.

        The prefetch does not trim: it runs while the last batch's body is still being sent. The trainer's next
        /batch (answered "no batch") does, once per batch served since the last trim, so a trainer polling an
        empty queue costs nothing."""
        if self._reader is not None:
            self._reader.clear()
        if trim and self._trimmed_at_step != self.step:
            self._trimmed_at_step = self.step
            return_free_memory()

    def _release_prefetch(self) -> None:
        if self._prefetched is not None:
            self.queue.release(self._prefetched[0])
            self._prefetched = None

    def _kick_prefetch(self) -> None:
        """After new groups arrive, form the next batch again if no batch could be formed before."""
        if self.config.prefetch and self._prefetched is None and self.registration is not None and self.started:
            if self._prefetch_task is None or self._prefetch_task.done():
                self._prefetch_task = asyncio.create_task(self._prefetch())

    async def latest_example(self) -> bytes | dict[str, Any]:
        if self.dormant and (self._handed["queued_groups"] or self._handed.get("last")):
            await self.wake()
        last = self.queue.last
        # the group posted last, served or not (as Atropos); across a recycle, the old image's
        key = (last.source, last.row) if last is not None else self._handed.get("last")
        if key is None:
            return EMPTY_EXAMPLE
        async with self._lock:
            table = await asyncio.to_thread(self.reader.read, [self._location(*key)])
        from factory.serve.payload import encode_groups

        return encode_groups(table)[0]

    async def reset(self) -> None:
        if self.dormant and self._handed["queued_groups"]:
            await self.wake()  # the groups it holds are recorded as discarded
        async with self._lock:
            self._release_prefetch()
            dropped = self.queue.clear()
            self.state.record_taken([(e.source, e.row) for e in dropped], DISCARDED)
            self.state.reset()
            self.registration, self.step, self.started = None, 0, False
            self.envs, self.requesters = [], []
            self._replay.clear()
            self.skipped_stale = self.skipped_oversize = 0
            self.unaligned.clear()
