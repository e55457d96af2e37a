"""Noticing a dead model server: the bookkeeping, and the pool failing at once (not at its deadline) when all are down."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from factory.inference.endpoints import EndpointPool
from factory.inference.health import EndpointHealth, EndpointsDown


def test_all_down_only_when_every_endpoint_failed_for_the_whole_window():
    now = [0.0]
    health = EndpointHealth(["http://a", "http://b"], fail_after=2, dead_after_s=20, clock=lambda: now[0])
    assert health.failed("http://a", "refused") is False and health.failed("http://a", "refused") is True
    now[0] = 25.0
    assert not health.all_down()  # b still answers
    health.failed("http://b", "timed out")
    now[0] = 44.0
    assert not health.all_down()  # b has failed for 19 s only
    now[0] = 45.0
    assert health.all_down()
    line = health.describe()
    assert "http://a failing for 45s (refused)" in line and "http://b failing for 20s (timed out)" in line
    assert "\n" not in line and "Restart the model server" in line
    assert health.ok("http://b") is True and not health.all_down()


class _DeadHttp:
    """Every request is refused, as by a killed server."""

    def __init__(self) -> None:
        self.calls = 0

    async def get(self, url: str, timeout: float = 5.0):
        self.calls += 1
        raise httpx.ConnectError("connection refused", request=httpx.Request("GET", url))


def test_a_pool_whose_endpoints_all_died_fails_waiting_requests_within_the_window():
    async def go():
        http = _DeadHttp()
        pool = EndpointPool(["http://a", "http://b"], cap=1, eject_after=1, probe_interval_s=0.05,
                            health_path="/health", http=http)
        pool.start_watch(interval_s=0.05, check_timeout_s=0.05, fail_after=2, dead_after_s=0.3)
        started = time.monotonic()
        try:
            with pytest.raises(EndpointsDown, match="every inference endpoint is down: http://a failing for"):
                # both out of rotation: without the watch this waits until the 60 s deadline
                await asyncio.sleep(0.2)
                await pool.acquire(time.monotonic() + 60)
            return time.monotonic() - started, http.calls
        finally:
            await pool.close()

    elapsed, calls = asyncio.run(go())
    assert elapsed < 5 and calls >= 4


def test_a_hung_endpoints_requests_are_cancelled_for_a_retry_elsewhere():
    async def go():
        pool = EndpointPool(["http://a"], cap=4, eject_after=3, probe_interval_s=10, health_path="/health",
                            http=_DeadHttp())
        ep = await pool.acquire(time.monotonic() + 1)

        async def request():
            task = asyncio.current_task()
            ep.requests.add(task)
            try:
                await asyncio.sleep(60)  # a server that accepted the request and hangs
            except asyncio.CancelledError:
                assert task in ep.abandoned and task.uncancel() == 0
                return "retried elsewhere"

        running = asyncio.create_task(request())
        await asyncio.sleep(0.01)
        pool.take_out(ep, "2 health checks failed in a row")
        result = await asyncio.wait_for(running, 2)
        await pool.close()
        return result, ep.healthy

    assert asyncio.run(go()) == ("retried elsewhere", False)
