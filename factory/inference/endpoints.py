"""The pool of endpoints behind one client: least-in-flight choice, a per-endpoint cap, eject and probe back.

An endpoint that fails `eject_after` times in a row (connection error, timeout,
5xx) is taken out of rotation; a background probe polls its health route and
puts it back once it answers 200. Requests wait (up to a deadline) while every
endpoint is full or out, unless a HealthWatch (factory/inference/health.py) has
found every endpoint down: then they fail at once with EndpointsDown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx

logger = logging.getLogger(__name__)


@dataclass
class Endpoint:
    """One server: its root URL (SGLang native routes; OpenAI routes under /v1) and its live state."""

    root: str
    in_flight: int = 0
    healthy: bool = True
    consecutive_failures: int = 0
    policy_version: int = 0
    last_failure: str | None = None
    served: int = 0
    probe: asyncio.Task | None = field(default=None, repr=False)
    requests: set = field(default_factory=set, repr=False)
    """Tasks with a request in flight here (cancelled when the endpoint is taken out by its health checks)."""
    abandoned: set = field(default_factory=set, repr=False)
    """Of those, the ones this pool cancelled (so the request is retried elsewhere, not the caller cancelled)."""


def endpoint_root(base_url: str) -> str:
    """`http://h:p/v1` and `http://h:p/` both name the server root `http://h:p`."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class NoEndpointAvailable(RuntimeError):
    """Every endpoint stayed full or out of rotation until the deadline."""


class EndpointPool:
    def __init__(self, roots: list[str], *, cap: int, eject_after: int, probe_interval_s: float, health_path: str,
                 http: Any) -> None:
        self.endpoints = [Endpoint(root) for root in roots]
        self.cap = cap
        self.eject_after = eject_after
        self.probe_interval_s = probe_interval_s
        self.health_path = health_path
        self._http = http
        self._waiters: deque[tuple[asyncio.Future, float]] = deque()  # (waiter, its monotonic deadline)
        self._expiry: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None
        self._turn = 0
        self.watch: Any = None
        """A started HealthWatch, or None (no background checks, no EndpointsDown)."""

    def start_watch(self, **settings: Any) -> None:
        """Check every endpoint's health in the background (call inside the client's event loop)."""
        from factory.inference.health import HealthWatch

        self.watch = HealthWatch(self, **settings)
        self.watch.start()

    def down_verdict(self) -> str | None:
        return self.watch.verdict() if self.watch is not None else None

    def _pick(self) -> Endpoint | None:
        best: Endpoint | None = None
        count = len(self.endpoints)
        for offset in range(count):  # rotate the start so ties spread across endpoints
            ep = self.endpoints[(self._turn + offset) % count]
            if ep.healthy and ep.in_flight < self.cap and (best is None or ep.in_flight < best.in_flight):
                best = ep
        self._turn += 1
        return best

    async def acquire(self, deadline: float) -> Endpoint:
        """The healthy endpoint with the fewest requests in flight, waiting for room until `deadline` (monotonic)."""
        while True:
            if (verdict := self.down_verdict()) is not None:
                from factory.inference.health import EndpointsDown

                raise EndpointsDown(verdict)
            ep = self._pick()
            if ep is not None:
                ep.in_flight += 1
                return ep
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                states = "; ".join(f"{e.root}: {'in rotation' if e.healthy else 'out'}, {e.in_flight} in flight, "
                                   f"last failure {e.last_failure}" for e in self.endpoints)
                raise NoEndpointAvailable(f"no inference endpoint had room before the deadline ({states})")
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            self._waiters.append((waiter, deadline))
            self._watch_deadlines(loop)
            try:
                await waiter  # woken by a release (room, maybe), a verdict, or its deadline
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # room was handed to this request as it was cancelled: hand it on
                raise

    EXPIRY_TICK_S = 0.05
    """How often waiting requests' deadlines are checked: one timer for all of them, not one per wait
    (`asyncio.wait_for` per wait cost the datagen bench ~3% of its CPU, issue 33); a deadline passes up to this late."""

    def _watch_deadlines(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._expiry is None or self._expiry[0] is not loop:
            self._expiry = (loop, loop.call_later(self.EXPIRY_TICK_S, self._expire, loop))

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake the waiters past their deadline (they then fail, unless room came); forget finished ones."""
        now = time.monotonic()
        waiting: deque[tuple[asyncio.Future, float]] = deque()
        for waiter, deadline in self._waiters:
            if waiter.done():
                continue
            if deadline <= now:
                waiter.set_result(None)
            else:
                waiting.append((waiter, deadline))
        self._waiters = waiting
        self._expiry = (loop, loop.call_later(self.EXPIRY_TICK_S, self._expire, loop)) if waiting else None

    def release(self, ep: Endpoint) -> None:
        ep.in_flight -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter, _ = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def wake_all(self) -> None:
        """Wake every waiting request (to see a new verdict)."""
        while self._waiters:
            waiter, _ = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def succeeded(self, ep: Endpoint) -> None:
        ep.consecutive_failures = 0
        ep.served += 1
        if self.watch is not None:
            self.watch.health.ok(ep.root)

    def failed(self, ep: Endpoint, reason: str, *, eject: bool = True) -> None:
        ep.last_failure = reason
        if not eject:
            return
        if self.watch is not None:
            self.watch.health.failed(ep.root, reason)
        ep.consecutive_failures += 1
        if ep.healthy and ep.consecutive_failures >= self.eject_after:
            logger.warning("taking %s out of rotation after %d failures in a row (last: %s)",
                           ep.root, ep.consecutive_failures, reason)
            ep.healthy = False
            self._start_probe(ep)

    def take_out(self, ep: Endpoint, reason: str) -> None:
        """Out of rotation now (its health checks fail); requests in flight on it are cancelled to be retried."""
        ep.last_failure = reason
        if ep.healthy:
            logger.warning("taking %s out of rotation: %s", ep.root, reason)
            ep.healthy = False
            self._start_probe(ep)
        for task in list(ep.requests):
            if task not in ep.abandoned and not task.done():
                ep.abandoned.add(task)
                task.cancel()

    def _start_probe(self, ep: Endpoint) -> None:
        if ep.probe is None or ep.probe.done():
            ep.probe = asyncio.create_task(self._probe(ep), name=f"probe {ep.root}")

    async def _probe(self, ep: Endpoint) -> None:
        while not ep.healthy:
            await asyncio.sleep(self.probe_interval_s)
            if await self.is_healthy(ep):
                logger.info("%s answers its health check again; back in rotation", ep.root)
                ep.healthy, ep.consecutive_failures = True, 0
                if self.watch is not None:
                    self.watch.health.ok(ep.root)
                for _ in range(self.cap):
                    self._wake()

    async def is_healthy(self, ep: Endpoint, timeout: float = 5.0) -> bool:
        try:
            response = await self._http.get(ep.root + self.health_path, timeout=timeout)
        except httpx.HTTPError as error:
            ep.last_failure = f"health check: {type(error).__name__}: {error}"
            return False
        if response.status_code != 200:
            ep.last_failure = f"health check: HTTP {response.status_code}"
        return response.status_code == 200

    async def check_all(self) -> None:
        """Probe every endpoint now; those that don't answer go out of rotation until they do."""
        results = await asyncio.gather(*(self.is_healthy(ep) for ep in self.endpoints))
        for ep, ok in zip(self.endpoints, results):
            if not ok and ep.healthy:
                logger.warning("%s fails its health check (%s); out of rotation until it passes", ep.root,
                               ep.last_failure)
                ep.healthy = False
                self._start_probe(ep)

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry[1].cancel()
            self._expiry = None
        if self.watch is not None:
            await self.watch.stop()
        for ep in self.endpoints:
            if ep.probe is not None and not ep.probe.done():
                ep.probe.cancel()
