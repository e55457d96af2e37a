"""Noticing a dead model server: background health checks on the endpoints in use, and the verdict "all down".

An `EndpointPool` alone only learns about a dead server from the requests that
fail on it, and while every endpoint is out of rotation requests wait for room
until their deadline (minutes, retried), so a run whose only server died sat
RUNNING and silent. `HealthWatch` closes that gap:

- while a client is open, a background task checks every endpoint's health
  route (`/health` for SGLang, `/v1/models` otherwise) every `interval_s`;
- an endpoint that fails `fail_after` checks in a row (connection refused, a
  hang past `check_timeout_s`, an error status), or that requests failed on
  enough times to take it out, is out of rotation; requests still in flight on
  it are cancelled (a hung server would hold them until the request timeout)
  and retried on the other endpoints;
- once every endpoint has been failing for `dead_after_s`, the pool answers
  every request with `EndpointsDown` at once: one line naming each endpoint and
  its last failure. The run fails with it instead of waiting.

`EndpointHealth` is the bookkeeping without asyncio or HTTP (unit-tested).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


class EndpointsDown(RuntimeError):
    """Every inference endpoint in use has been failing its health checks for the configured time."""


@dataclass
class _State:
    failing_since: float | None = None
    failures_in_a_row: int = 0
    last_failure: str | None = None


class EndpointHealth:
    """Per endpoint: since when it has been failing and why; whether all of them are down."""

    def __init__(self, roots: list[str], *, fail_after: int = 2, dead_after_s: float = 20.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.roots = list(roots)
        self.fail_after = fail_after
        self.dead_after_s = dead_after_s
        self.clock = clock
        self._state = {root: _State() for root in self.roots}

    def ok(self, root: str) -> bool:
        """Record a passed check or a served request; whether the endpoint had been failing."""
        state = self._state[root]
        was_failing = state.failing_since is not None
        state.failing_since, state.failures_in_a_row = None, 0
        return was_failing

    def failed(self, root: str, reason: str) -> bool:
        """Record a failed check or a connection failure; whether the endpoint should now be out of rotation."""
        state = self._state[root]
        if state.failing_since is None:
            state.failing_since = self.clock()
        state.failures_in_a_row += 1
        state.last_failure = reason
        return state.failures_in_a_row >= self.fail_after

    def failing_for(self, root: str) -> float:
        since = self._state[root].failing_since
        return 0.0 if since is None else self.clock() - since

    def all_down(self) -> bool:
        """Every endpoint failing for at least dead_after_s (asked before every request: a plain loop that stops
        at the first healthy endpoint, not a generator over all of them)."""
        for root in self.roots:
            since = self._state[root].failing_since
            if since is None or self.clock() - since < self.dead_after_s:
                return False
        return bool(self.roots)

    def describe(self) -> str:
        """One line: every endpoint with how long it has failed and its last failure."""
        parts = [f"{root} failing for {self.failing_for(root):.0f}s ({self._state[root].last_failure})"
                 for root in self.roots]
        return (f"every inference endpoint is down: {'; '.join(parts)}. Restart the model server (or fix "
                "openai.base_url) and rerun with the same run id: committed chunks are kept")


class HealthWatch:
    """The background checker of one EndpointPool (started by the pool when its client opens)."""

    def __init__(self, pool: Any, *, interval_s: float = 5.0, check_timeout_s: float = 5.0, fail_after: int = 2,
                 dead_after_s: float = 20.0) -> None:
        self.pool = pool
        self.interval_s = interval_s
        self.check_timeout_s = check_timeout_s
        self.health = EndpointHealth([ep.root for ep in pool.endpoints], fail_after=fail_after,
                                     dead_after_s=dead_after_s)
        self._task: asyncio.Task | None = None
        self._announced = False

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="endpoint health watch")

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping
                pass

    def verdict(self) -> str | None:
        """The one-line cause when every endpoint is down, else None (announced once as a warning)."""
        if not self.health.all_down():
            self._announced = False
            return None
        message = self.health.describe()
        if not self._announced:
            logger.error(message)
            self._announced = True
        return message

    async def check_now(self) -> None:
        results = await asyncio.gather(*(self.pool.is_healthy(ep, timeout=self.check_timeout_s)
                                         for ep in self.pool.endpoints))
        for ep, passed in zip(self.pool.endpoints, results):
            if passed:
                self.health.ok(ep.root)
            elif self.health.failed(ep.root, ep.last_failure or "health check failed"):
                self.pool.take_out(ep, f"{self.health._state[ep.root].failures_in_a_row} health checks failed in a "
                                   f"row ({ep.last_failure})")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_now()
            except Exception as error:  # noqa: BLE001 - the watch itself must not die
                logger.warning("endpoint health check failed: %s", error)
            if self.verdict() is not None:
                self.pool.wake_all()  # requests waiting for room fail now instead of at their deadline
