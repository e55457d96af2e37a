"""Group commit of POSTed groups: every request waits until its groups are in a committed shard.

Requests put their groups (rows of GROUP_SCHEMA) on a pending list and wait; one writer
takes everything pending, commits it as a single shard (producer, next chunk)
in a worker thread, and then wakes all those requests at once. While a commit
is being written, new requests pile up for the next one, so ingest speed
grows with concurrency instead of paying one fsync per group.

Requests announce themselves when their bodies start decoding (`announce`).
Before a commit, the writer lingers (at most `linger_s`) for the requests
being decoded at that moment (without `linger_queued`, not those still queued
for a decoder): a shard
has a fixed cost (Parquet writer and footer, three fsyncs, the commit record)
worth sharing among as many groups as are about to arrive. A lone client
never waits: nobody else is on the way. With `linger_queued` (config
commit_linger_queued, on by default) a commit also lingers for bodies that
were read and still wait for a decoder: one-group posts from 8 clients fill
~4-5 groups per shard instead of ~3.9, ~4% less server CPU per group
(bench/RESULTS.md, issue 29, "The fixed cost of a commit").

Up to `concurrency` commits run at once (config commit_concurrency, default
1): with more, posts that arrive while a shard is being encoded and fsynced
start the next one instead of waiting for it (the store serialises only the
commit log's append). With one writer the commit is the serial step of
one-group posts (bench.serve, 8 clients: ~80% of the ingest's wall time, at
~4 groups per shard); a second writer helped where CPU was idle (1.2-1.7x
groups/s) and not on a saturated machine (0.9-1.0x), where its smaller
shards cost 5-12% more CPU per group.

With `pipeline` (config commit_pipeline, on by default) one more commit may
start once every running one has encoded and written its shard: the rest of
a commit is the shard's and its directory's fsyncs (issued together) and the
commit record's append and fsync, waits on the disk (~6 ms of a ~20 ms
one-group commit on this machine's ext4 volume while other writers kept it
busy, ~1 ms when it was idle), and the next shard is encoded meanwhile. Only one shard is encoded at a time, so shards stay as big as with
one writer. Commits are indexed and answered in the order they started (a
later one that finishes first waits), and each post still only once its own
shard is committed (bench/RESULTS.md, issue 29, "Overlapping a commit's fsyncs").
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any
from contextlib import contextmanager
from dataclasses import dataclass, field

import pyarrow as pa

from factory.serve.memory import limit_malloc_arenas, return_free_memory
from factory.store import CommitRecord, StoreError, shard_name
from factory.store_object import StoreReader

logger = logging.getLogger(__name__)

TRIM_EVERY_BYTES = 64 << 20
"""Give freed heap back to the OS after about this many bytes of groups were committed."""


def limit_allocator_growth() -> None:
    """Few malloc arenas and Arrow's buffers in that same malloc: the service's RSS follows what it holds, not
    what it once parsed.

    Arrow's jemalloc pool kept ~150 MiB after a drain even with its decay at 0 (bench.serve, 384 groups:
    RSS 1 s after the drain 349 MiB vs 195-204 MiB with the system pool, same ingest CPU per group); with the
    system pool, `return_free_memory` (malloc_trim) gives Arrow's freed buffers back too. This sets the pool of
    pyarrow's Python functions; Arrow's C++ default (the Parquet writer's) is set by `limit_malloc_arenas`."""
    if limit_malloc_arenas():
        pa.set_memory_pool(pa.system_memory_pool())
        return
    try:
        pa.jemalloc_set_decay_ms(0)
    except (NotImplementedError, pa.ArrowNotImplementedError, AttributeError):
        pass


@dataclass
class Arrival:
    """A request on its way to `GroupCommitter.submit`: announced once its body is being decoded."""

    announced: bool = False
    settled: bool = False


Rows = Any
"""A request's rows: a pa.RecordBatch, or rows `build_table` turns into Arrow columns (wire.DeferredRows); either
has `num_rows`."""


@dataclass
class _Pending:
    rows: Rows
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class GroupCommitter:
    """Commits pending groups as shards of (run, producer, chunk), one writer at a time."""

    def __init__(
        self,
        store: StoreReader,
        run_id: str,
        producer: str,
        on_commit: Callable[[CommitRecord, pa.Table], Awaitable[None] | None],
        *,
        max_groups: int = 1024,
        row_group_groups: int = 16,
        linger_s: float = 0.0,
        concurrency: int = 1,
        linger_queued: bool = False,
        pipeline: bool = False,
        build_table: Callable[[list[Rows]], pa.Table] | None = None,
    ) -> None:
        self.store, self.run_id, self.producer = store, run_id, producer
        self.on_commit = on_commit
        self.max_groups = max_groups
        self.row_group_groups = row_group_groups
        self.linger_s = linger_s
        self.linger_queued = linger_queued
        self.concurrency = max(1, concurrency)
        self.pipeline = pipeline
        self.build_table = build_table or pa.Table.from_batches
        """A commit's rows (what was submitted, in order) as one table; called in the commit's thread."""
        self._encoding = 0  # commits whose shard is not yet encoded and written (pipeline: the next waits for none)
        self._answered: asyncio.Future[None] | None = None  # the last commit's: commits answer in the order they started
        self._running: set[asyncio.Task[None]] = set()
        self._pending: list[_Pending] = []
        self._wake = asyncio.Event()
        self._moved = asyncio.Event()
        self._announced = 0
        self._announcing = threading.Lock()
        self._settled = 0
        self._task: asyncio.Task[None] | None = None
        self.next_chunk = 1 + max(
            (record.chunk for record in store.committed(run_id).values() if record.producer == producer), default=-1
        )
        self.commits = 0
        self._since_trim = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="group-committer")

    @property
    def idle(self) -> bool:
        """Nothing pending, being committed, or announced as arriving."""
        return not self._pending and not self._running and self._announced == self._settled

    async def stop(self) -> None:
        """Commit what is pending, then stop."""
        if self._task is None:
            return
        while self._pending or self._running:
            await asyncio.sleep(0.01)
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None

    @contextmanager
    def arriving(self) -> Iterator[Arrival]:
        """A request on its way; `announce` it when its body starts decoding. It is settled by `submit` or when
        the block ends."""
        arrival = Arrival()
        if self.linger_queued:  # waited for from here on, not only once a decoder takes it
            self.announce(arrival)
        try:
            yield arrival
        finally:
            self._settle(arrival)

    def announce(self, arrival: Arrival) -> None:
        """The body of `arrival` is being decoded now (any thread): a commit about to start waits for it.
        Bodies still queued for a decoder are not waited for (unless `linger_queued`): they would hold the
        commit for a whole queue."""
        with self._announcing:
            if arrival.announced:  # announced when it arrived (linger_queued)
                return
            arrival.announced = True
            self._announced += 1

    def _settle(self, arrival: Arrival | None) -> None:
        if arrival is not None and arrival.announced and not arrival.settled:
            arrival.settled = True
            self._settled += 1
            self._moved.set()

    async def submit(self, rows: Rows, arrival: Arrival | None = None) -> None:
        """Return once `rows` are committed to a shard (raises if the commit failed)."""
        if self._task is None or self._task.done():
            raise RuntimeError("the group committer is not running; start the service before posting groups")
        pending = _Pending(rows)
        self._pending.append(pending)
        self._settle(arrival)
        self._wake.set()
        await pending.done

    async def _linger(self) -> None:
        """Wait (at most linger_s) for the requests that were already decoding when this commit came due."""
        if self.linger_s <= 0:
            return
        loop = asyncio.get_running_loop()
        expected, deadline = self._announced, loop.time() + self.linger_s
        while self._settled < expected and sum(p.rows.num_rows for p in self._pending) < self.max_groups:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._moved.clear()
            try:
                await asyncio.wait_for(self._moved.wait(), remaining)
            except asyncio.TimeoutError:
                return

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending and self._may_start():
                await self._linger()
                task = asyncio.create_task(self._commit_and_answer(self._take()))
                self._running.add(task)
                task.add_done_callback(self._finished)
            # No local of this loop refers to a commit's rows while it waits for the next: those of the last commit
            # (up to max_groups decoded groups, ~15 MiB after a few 64-group posts) stayed alive until another post.

    def _may_start(self) -> bool:
        """Another commit may start: fewer than `concurrency` are running, or (pipeline) one more than that while
        none of them is still encoding its shard, only waiting for its fsyncs and commit record."""
        running = len(self._running)
        return running < self.concurrency or (self.pipeline and self._encoding == 0 and running <= self.concurrency)

    def _take(self) -> list[_Pending]:
        """The pending requests of the next commit, oldest first, up to max_groups groups (at least one request)."""
        take, count = [], 0
        while self._pending and (not take or count + self._pending[0].rows.num_rows <= self.max_groups):
            item = self._pending.pop(0)
            take.append(item)
            count += item.rows.num_rows
        return take

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._wake.set()  # a writer is free: what piled up meanwhile goes next

    async def _commit_and_answer(self, take: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        built: list[pa.Table] = []  # the commit's rows as one table, built in its thread
        encoding = [True]
        self._encoding += 1
        previous, answered = self._answered, loop.create_future()
        self._answered = answered

        def written() -> None:  # the commit's thread: the shard is encoded, its fsyncs and record are still to come
            loop.call_soon_threadsafe(self._written, encoding)

        try:
            record = await self._commit([item.rows for item in take], built, written)
            groups = built[0]
            self._written(encoding)
            if previous is not None:  # served and answered in the order the commits started (set in a finally)
                await asyncio.shield(previous)  # shielded: cancelling this commit does not end the one before's
            result = self.on_commit(record, groups)
            if asyncio.iscoroutine(result):
                await result
        except Exception as error:  # noqa: BLE001 - every waiting request must learn the commit failed
            count = sum(item.rows.num_rows for item in take)
            if isinstance(error, StoreError):  # a full or failing disk: the message names the path
                logger.error("commit of %d posted groups failed: %s", count, error)
            else:
                logger.exception("commit of %d posted groups failed", count)
            for item in take:
                if not item.done.done():
                    item.done.set_exception(error)
            return
        finally:
            self._written(encoding)
            if not answered.done():
                answered.set_result(None)
            if self._answered is answered:
                self._answered = None
        for item in take:
            if not item.done.done():
                item.done.set_result(None)

    def _written(self, encoding: list[bool]) -> None:
        """A commit's shard is written (or the commit ended): a pipelined next commit may start."""
        if encoding[0]:
            encoding[0] = False
            self._encoding -= 1
            self._wake.set()

    async def _commit(self, parts: list[Rows], built: list[pa.Table], written: Callable[[], None] | None = None) -> CommitRecord:
        """Commit `parts` as one shard; `built` gets their table (built in the commit's thread, once)."""
        unbuilt = [parts]  # emptied once built: the thread's work item, which outlives the call a moment, keeps no rows
        del parts

        def build_and_commit(chunk: int) -> CommitRecord:
            if not built:
                built.append(self.build_table(unbuilt.pop()))
            return self.store.commit(self.run_id, self.producer, chunk, built[0], row_group_groups=self.row_group_groups,
                                     on_written=written)

        while True:
            chunk = self.next_chunk
            self.next_chunk += 1
            name = shard_name(self.producer, chunk)
            existed = self.store.record(self.run_id, name) is not None  # the log's new end only, no copy of every record
            try:
                record = await asyncio.to_thread(build_and_commit, chunk)
            except Exception:
                # The commit log is the truth: a commit whose record is in it is stored, whatever was raised after.
                if not built:  # the rows could not be built: nothing was written
                    raise
                logged = await asyncio.to_thread(self.store.committed, self.run_id)
                record = logged.get(name)
                if record is None or existed or record.rows != built[0].num_rows:
                    raise
                logger.warning("the commit of chunk %d raised after its record was durable; counted as committed", chunk)
            groups = built[0]
            if not record.skipped:
                self.commits += 1
                self._since_trim += groups.nbytes
                if self._since_trim >= TRIM_EVERY_BYTES:
                    self._since_trim = 0
                    await asyncio.to_thread(return_free_memory)
                return record
            logger.warning("chunk %d of %s/%s was already committed (another writer?); using the next", chunk, self.run_id, self.producer)
