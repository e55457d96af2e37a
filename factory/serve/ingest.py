"""Group commit of POSTed groups: a request is answered once its groups are durable in the write-ahead log.

Requests put their groups (rows of GROUP_SCHEMA) on a pending list and wait; one writer
takes everything pending, writes it as one chunk of the write-ahead log (`IngestLog`) in
a worker thread, hands it to `on_logged` (the service queues it: servable at once, read
from memory until its shard exists), and then wakes all those requests at once. While a
chunk is being written, new requests pile up for the next one, so ingest speed grows with
concurrency instead of paying one fsync per group.

Behind the log, a shard writer turns each chunk into the Parquet shard of the same
(producer, chunk), commits it to the store, calls `on_sharded` and deletes the chunk from
the log. Parquet encoding, the bulk of a commit's time, is thus off the requests' path.
Chunks waiting for their shard are bounded (`backlog_bytes`); beyond that, new chunks wait.

Requests announce themselves when their bodies start decoding (`arriving`).
Before a chunk, the writer lingers (at most `linger_s`) for the requests that
were already decoding: a chunk, and the shard it becomes, have a fixed cost
worth sharing among as many groups as are about to arrive. A lone client never
waits: nobody else is on the way.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pyarrow as pa

from factory.serve.ingest_log import IngestLog
from factory.store import shard_name

logger = logging.getLogger(__name__)

_M_ARENA_MAX = -8
TRIM_EVERY_BYTES = 64 << 20
"""Give freed heap back to the OS after about this many bytes of groups were committed."""


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def limit_allocator_growth() -> None:
    """Few malloc arenas (decoding threads otherwise each keep their own high-water mark) and Arrow's
    jemalloc giving pages back at once: the service's RSS follows what it holds, not what it once parsed."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_ARENA_MAX, 2)
    try:
        pa.jemalloc_set_decay_ms(0)
    except (NotImplementedError, pa.ArrowNotImplementedError, AttributeError):
        pass


def return_free_memory() -> None:
    """Give freed heap pages back to the OS (glibc), e.g. after a commit freed a batch of decoded groups."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


@dataclass
class Arrival:
    """A request on its way to `GroupCommitter.submit` (its body is being decoded)."""

    settled: bool = False


@dataclass
class _Pending:
    rows: pa.RecordBatch
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class GroupCommitter:
    """Logs pending groups as chunks of (run, producer), one writer at a time, and shards them behind."""

    def __init__(
        self,
        log: IngestLog,
        on_logged: Callable[[str, pa.Table], None],
        on_sharded: Callable[[str], None],
        *,
        max_groups: int = 1024,
        row_group_groups: int = 16,
        linger_s: float = 0.0,
        backlog_bytes: int = 256 << 20,
    ) -> None:
        self.log, self.store = log, log.store
        self.on_logged, self.on_sharded = on_logged, on_sharded
        self.max_groups = max_groups
        self.row_group_groups = row_group_groups
        self.linger_s = linger_s
        self.backlog_bytes = backlog_bytes
        self._pending: list[_Pending] = []
        self._wake = asyncio.Event()
        self._moved = asyncio.Event()
        self._announced = 0
        self._settled = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._backlog: deque[tuple[int, pa.Table]] = deque()
        self._backlog_size = 0
        self._logged = asyncio.Event()
        self._sharded = asyncio.Event()
        committed = (r.chunk for r in self.store.committed(log.run_id).values() if r.producer == log.producer)
        self.next_chunk = 1 + max([*committed, *log.chunks()], default=-1)
        self.commits = 0
        self._since_trim = 0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(), name="group-logger"),
                       asyncio.create_task(self._shard_loop(), name="shard-writer")]

    async def drain(self) -> None:
        """Wait until every submitted group is in a committed shard."""
        while self._pending or self._backlog:
            self._sharded.clear()
            try:
                await asyncio.wait_for(self._sharded.wait(), 0.05)
            except asyncio.TimeoutError:
                pass

    async def stop(self, timeout_s: float = 60.0) -> None:
        """Log and shard what is pending (for at most `timeout_s`: what is logged is sharded at the next start), then stop."""
        if not self._tasks:
            return
        deadline = asyncio.get_running_loop().time() + timeout_s
        while (self._pending or self._backlog) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        for task in self._tasks:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []

    @contextmanager
    def arriving(self) -> Iterator[Arrival]:
        """Announce a request whose rows are being made; it is settled by `submit` or when the block ends."""
        arrival = Arrival()
        self._announced += 1
        try:
            yield arrival
        finally:
            self._settle(arrival)

    def _settle(self, arrival: Arrival | None) -> None:
        if arrival is not None and not arrival.settled:
            arrival.settled = True
            self._settled += 1
            self._moved.set()

    async def submit(self, rows: pa.RecordBatch, arrival: Arrival | None = None) -> None:
        """Return once `rows` are durable in the log (raises if writing it failed)."""
        if not self._tasks or self._tasks[0].done():
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
            while self._pending:
                while self._backlog_size > self.backlog_bytes:
                    self._sharded.clear()
                    await self._sharded.wait()
                await self._linger()
                take, count = [], 0
                while self._pending and (not take or count + self._pending[0].rows.num_rows <= self.max_groups):
                    item = self._pending.pop(0)
                    take.append(item)
                    count += item.rows.num_rows
                groups = pa.Table.from_batches([item.rows for item in take])
                chunk = self.next_chunk
                self.next_chunk += 1
                try:
                    await asyncio.to_thread(self.log.write, chunk, groups)
                    self.on_logged(shard_name(self.log.producer, chunk), groups)
                except Exception as error:  # noqa: BLE001 - every waiting request must learn the write failed
                    logger.exception("logging %d posted groups failed", groups.num_rows)
                    for item in take:
                        if not item.done.done():
                            item.done.set_exception(error)
                    continue
                self._backlog.append((chunk, groups))
                self._backlog_size += groups.nbytes
                self._logged.set()
                for item in take:
                    if not item.done.done():
                        item.done.set_result(None)

    async def _shard_loop(self) -> None:
        while True:
            while not self._backlog:
                self._logged.clear()
                await self._logged.wait()
            chunk, groups = self._backlog[0]
            try:
                record = await asyncio.to_thread(
                    self.store.commit, self.log.run_id, self.log.producer, chunk, groups, row_group_groups=self.row_group_groups
                )
            except Exception:  # noqa: BLE001 - the chunk stays logged and queued; try again
                logger.exception("shard of logged chunk %d (%d groups) failed; retrying in 1 s", chunk, groups.num_rows)
                await asyncio.sleep(1.0)
                continue
            if record.skipped:
                logger.error("chunk %d of %s/%s was already committed by another writer: its logged groups stay in %s",
                             chunk, self.log.run_id, self.log.producer, self.log.path(chunk))
            else:
                self.commits += 1
                self.on_sharded(record.shard)
                await asyncio.to_thread(self.log.remove, chunk)
            self._backlog.popleft()
            self._backlog_size -= groups.nbytes
            self._sharded.set()
            self._since_trim += groups.nbytes
            if self._since_trim >= TRIM_EVERY_BYTES:
                self._since_trim = 0
                await asyncio.to_thread(return_free_memory)
