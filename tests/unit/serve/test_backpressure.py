"""The ingest byte budget: bounded bytes in flight, FIFO waiting, 503 (Overloaded) when the line is too long or too slow."""

from __future__ import annotations

import asyncio

import pytest

from factory.serve.backpressure import IngestBudget, Overloaded


def test_budget_bounds_bytes_in_use_and_serves_waiters_in_order():
    async def scenario():
        budget = IngestBudget(100, max_waiting_bytes=1000, max_wait_s=5)
        order, peak = [], []

        async def job(name: str, size: int) -> None:
            async with budget.reserve(size):
                peak.append(budget.in_use)
                order.append(name)
                await asyncio.sleep(0.01)

        await asyncio.gather(*(job(f"j{i}", 60) for i in range(5)), job("huge", 500))
        assert order == ["j0", "j1", "j2", "j3", "j4", "huge"]
        assert max(peak) == 500 and all(p <= 100 for p in peak[:-1])  # an oversized request runs alone
        assert budget.in_use == 0 and budget.waiting_bytes == 0

    asyncio.run(scenario())


def test_long_line_or_long_wait_is_overloaded_with_retry_after():
    async def scenario():
        budget = IngestBudget(100, max_waiting_bytes=150, max_wait_s=0.1, retry_after_s=2)
        await budget.acquire(100)
        waiter = asyncio.create_task(budget.acquire(100))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as error:
            await budget.acquire(100)  # 200 bytes would be waiting
        assert error.value.retry_after_s == 2
        with pytest.raises(Overloaded):
            await waiter  # waited longer than max_wait_s
        assert budget.waiting_bytes == 0 and budget.rejected == 2
        budget.release(100)
        await asyncio.wait_for(budget.acquire(100), 1)

    asyncio.run(scenario())
