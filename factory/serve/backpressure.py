"""Bound the bytes of posted bodies being ingested at once; beyond that, wait a little, then answer 503.

Decoding a body makes Python objects several times its size until its rows
are Arrow buffers, so N concurrent 64-group posts would need N times that.
A request reserves its (decompressed) body size before decoding and releases
it once its groups are committed; while the budget is spent it waits in line
(FIFO), and if the line itself is too long or it has waited `max_wait_s`, it
gets 503 with Retry-After, which Atropos's and our env clients retry.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Overloaded(Exception):
    """The ingest budget stayed spent: answer 503 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class IngestBudget:
    """A FIFO byte semaphore: at most `max_bytes` in use (one oversized request may run alone)."""

    def __init__(self, max_bytes: int, *, max_waiting_bytes: int, max_wait_s: float, retry_after_s: float = 1.0) -> None:
        self.max_bytes, self.max_waiting_bytes = max_bytes, max_waiting_bytes
        self.max_wait_s, self.retry_after_s = max_wait_s, retry_after_s
        self.in_use = 0
        self.waiting_bytes = 0
        self.peak_in_use = 0
        self.rejected = 0
        self._line: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def _fits(self, size: int) -> bool:
        return self.in_use == 0 or self.in_use + size <= self.max_bytes

    def _wake(self) -> None:
        while self._line and self._fits(self._line[0][0]):
            size, future = self._line.popleft()
            self.waiting_bytes -= size
            if not future.done():
                self.in_use += size
                self.peak_in_use = max(self.peak_in_use, self.in_use)
                future.set_result(None)

    async def acquire(self, size: int) -> None:
        if not self._line and self._fits(size):
            self.in_use += size
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            return
        if self.waiting_bytes + size > self.max_waiting_bytes:
            self.rejected += 1
            raise Overloaded(f"ingest is saturated ({self.waiting_bytes} bytes already waiting); retry later", self.retry_after_s)
        future = asyncio.get_running_loop().create_future()
        entry = (size, future)
        self._line.append(entry)
        self.waiting_bytes += size
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(future), self.max_wait_s)
            return
        except asyncio.TimeoutError:
            self._give_up(entry)
        except asyncio.CancelledError:  # the client went away while waiting
            self._give_up(entry)
            raise
        self.rejected += 1
        raise Overloaded(f"ingest stayed saturated for {time.monotonic() - started:.1f} s; retry later", self.retry_after_s)

    def _give_up(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        size, future = entry
        if future.done() and not future.cancelled():
            self.release(size)  # granted just as we gave up
            return
        future.cancel()
        try:
            self._line.remove(entry)
            self.waiting_bytes -= size
        except ValueError:
            pass
        self._wake()

    def release(self, size: int) -> None:
        self.in_use -= size
        self._wake()

    @asynccontextmanager
    async def reserve(self, size: int) -> AsyncIterator[None]:
        await self.acquire(size)
        try:
            yield
        finally:
            self.release(size)

    def status(self) -> dict[str, int]:
        return {"in_use_bytes": self.in_use, "waiting_bytes": self.waiting_bytes, "peak_in_use_bytes": self.peak_in_use,
                "rejected_requests": self.rejected}
