"""Endpoint choice without HTTP: least in flight, the per-endpoint cap, ejection after repeated failures."""

from __future__ import annotations

import asyncio
import time

import pytest

from factory.inference.endpoints import EndpointPool, NoEndpointAvailable


def _pool(cap: int = 2, eject_after: int = 2) -> EndpointPool:
    return EndpointPool(["http://a", "http://b"], cap=cap, eject_after=eject_after, probe_interval_s=60,
                        health_path="/health", http=None)


def test_least_in_flight_then_cap_then_wait_for_a_release() -> None:
    async def go():
        pool = _pool(cap=2)
        deadline = time.monotonic() + 1
        taken = [await pool.acquire(deadline) for _ in range(4)]
        assert sorted(ep.root for ep in taken) == ["http://a", "http://a", "http://b", "http://b"]
        waiter = asyncio.create_task(pool.acquire(time.monotonic() + 1))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # both endpoints at their cap
        pool.release(taken[0])
        assert (await waiter).root == taken[0].root
        with pytest.raises(NoEndpointAvailable, match="http://a"):
            await pool.acquire(time.monotonic() + 0.05)

    asyncio.run(go())


def test_repeated_failures_take_an_endpoint_out_and_a_success_resets_the_count() -> None:
    async def go():
        pool = _pool(eject_after=2)
        a, b = pool.endpoints
        pool.failed(a, "HTTP 500")
        pool.succeeded(a)
        pool.failed(a, "HTTP 500")
        assert a.healthy  # not two in a row
        pool.failed(a, "HTTP 503")
        assert not a.healthy and a.last_failure == "HTTP 503"
        pool.failed(b, "HTTP 429", eject=False)
        pool.failed(b, "HTTP 429", eject=False)
        assert b.healthy  # rate limits never eject
        chosen = [await pool.acquire(time.monotonic() + 1) for _ in range(2)]
        assert {ep.root for ep in chosen} == {"http://b"}
        await pool.close()

    asyncio.run(go())


def test_a_waiter_cancelled_as_room_reaches_it_hands_the_room_on() -> None:
    async def go():
        pool = _pool(cap=1)
        pool.endpoints.pop()  # one endpoint, one slot
        taken = await pool.acquire(time.monotonic() + 1)
        first = asyncio.create_task(pool.acquire(time.monotonic() + 5))
        second = asyncio.create_task(pool.acquire(time.monotonic() + 5))
        await asyncio.sleep(0.01)
        pool.release(taken)  # wakes `first`...
        first.cancel()  # ...which is cancelled before it runs
        assert (await asyncio.wait_for(second, 1)).root == "http://a"
        assert first.cancelled()
        started = time.monotonic()
        with pytest.raises(NoEndpointAvailable):  # a deadline still ends a wait, within a tick of it
            await pool.acquire(time.monotonic() + 0.1)
        assert 0.1 <= time.monotonic() - started < 0.1 + 2 * pool.EXPIRY_TICK_S + 0.2
        await pool.close()

    asyncio.run(go())
