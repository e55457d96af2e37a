"""Serve-mode backpressure: pause datagen while the trainer is behind.

Follows Atropos's `max_batches_offpolicy`: before each chunk, pause while the
batching API's queue (GET /status `queue_size`, in groups), plus the flow's
groups in flight or not yet indexed, times group_size reaches
`max_batches_offpolicy` x batch_size (batch_size from GET /info unless
configured).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx

logger = logging.getLogger(__name__)


class Backpressure:
    """Asks the batching API how far the trainer is behind and waits until it catches up.

    Like Atropos's env, the flow counts its own work the queue does not show yet: items in chunks still in
    flight, and groups it committed that the API has not indexed (it follows the store every
    `follow_interval_s`). Indexed groups are read from our API's /status (queue_size + served_groups +
    skipped); against an API without those keys only the in-flight items are added.
    """

    def __init__(self, serve: Any, group_size: int, *, timeout: float = 10.0) -> None:
        self.api_url = serve.api_url.rstrip("/")
        self.max_batches = serve.max_batches_offpolicy
        self.batch_size = serve.batch_size
        self.poll_s = serve.poll_s
        self.group_size = group_size
        self.http = httpx.Client(timeout=timeout)
        self.committed = 0
        """Groups this flow committed since it started."""
        self._indexed_base: int | None = None
        self._indexed_last = 0

    def _get(self, path: str) -> dict[str, Any]:
        response = self.http.get(f"{self.api_url}{path}")
        response.raise_for_status()
        return response.json()

    def limit(self) -> int | None:
        """Sequences the queue may hold before the flow pauses; None while the trainer has not registered."""
        if self.batch_size <= 0:
            batch_size = int(self._get("/info").get("batch_size", -1))
            if batch_size <= 0:
                return None
            self.batch_size = batch_size
        return self.max_batches * self.batch_size

    def unseen(self, status: dict[str, Any]) -> int:
        """Groups this flow committed that the API has not indexed yet (0 if its /status cannot tell)."""
        if "served_groups" not in status:
            return 0
        indexed = sum(int(status.get(key, 0)) for key in ("queue_size", "served_groups", "skipped_stale", "skipped_oversize"))
        if self._indexed_base is None:
            self._indexed_base = indexed - self.committed
        elif indexed < self._indexed_last:  # /reset_data started a new epoch of served counts
            self._indexed_base -= self._indexed_last - indexed
        self._indexed_last = indexed
        return max(0, self.committed - (indexed - self._indexed_base))

    def behind(self, in_flight_items: int = 0) -> bool:
        if self.max_batches <= 0:
            return False
        limit = self.limit()
        if limit is None:
            return True  # Atropos waits for the trainer to register before producing
        status = self._get("/status")
        pending = int(status.get("queue_size", 0)) + self.unseen(status) + in_flight_items
        return pending * self.group_size >= limit

    def would_wait(self, in_flight_items: int) -> bool:
        """Whether the next chunk has to wait (also when the API does not answer)."""
        try:
            return self.behind(in_flight_items)
        except (httpx.HTTPError, ValueError):
            return True

    def wait(self, log: Any = logger) -> float:
        """Block while the trainer is behind; returns the seconds paused. API outages are retried, not fatal."""
        started = time.monotonic()
        announced = False
        while True:
            try:
                if not self.behind():
                    break
            except (httpx.HTTPError, ValueError) as error:
                log.warning("batching API %s not answering (%s); retrying in %.1fs", self.api_url, error, self.poll_s)
            if not announced:
                log.info("paused: the trainer is %d+ batches behind (or not registered); waiting", self.max_batches)
                announced = True
            time.sleep(self.poll_s)
        paused = time.monotonic() - started
        if announced:
            log.info("resumed after %.1fs", paused)
        return paused
