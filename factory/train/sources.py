"""Where a trainer's batches come from: the batching API (`/register` + `/batch`) or a run's shards offline.

Both are resumable by step: `start(step)` makes the next batch the one that
step S would have got, so a restarted trainer neither skips nor repeats a
batch. The API does that itself (re-registering with `starting_step` replays
what it served from S on); the store source packs batches deterministically
from the commit order and skips the first S.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson

from factory.store import ShardStore

logger = logging.getLogger(__name__)


class NoMoreBatches(RuntimeError):
    """The source is exhausted (store) or gave nothing for `max_wait_s` (API)."""


class BudgetSpent(NoMoreBatches):
    """No batch came before the trainer's wall-clock budget ran out (the caller's `until`)."""


class ApiBatchSource:
    """An Atropos-protocol trainer client."""

    def __init__(self, url: str, *, batch_size: int, max_token_len: int, num_steps: int, token: str | None = None,
                 poll_s: float = 0.5, max_wait_s: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=60.0)
        self.batch_size, self.max_token_len, self.num_steps = batch_size, max_token_len, num_steps
        self.poll_s, self.max_wait_s = poll_s, max_wait_s

    def start(self, step: int) -> None:
        """Register (again) with `starting_step`; waits for the API to come up."""
        body = {"wandb_group": "factory", "wandb_project": "factory", "batch_size": self.batch_size,
                "max_token_len": self.max_token_len, "checkpoint_dir": "", "save_checkpoint_interval": -1,
                "starting_step": step, "num_steps": self.num_steps}
        deadline = time.monotonic() + self.max_wait_s
        while True:
            try:
                response = self.http.post("/register", json=body)
                response.raise_for_status()
                logger.info("registered with %s at step %d", self.http.base_url, step)
                return
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(self.poll_s)

    def next_batch(self, until: float | None = None) -> list[dict[str, Any]]:
        """The next batch; waits up to `max_wait_s`, and never past `until` (a time.monotonic() value: the
        trainer's budget), raising NoMoreBatches or BudgetSpent."""
        deadline = time.monotonic() + self.max_wait_s
        budget_first = until is not None and until < deadline
        if budget_first:
            deadline = until
        while True:
            try:
                response = self.http.get("/batch")
            except httpx.TransportError as error:
                # a kept-alive connection the API closed under load ("Server disconnected"): ask again
                if time.monotonic() > deadline:
                    raise
                logger.warning("GET /batch failed (%s: %s); retrying", type(error).__name__, error)
                time.sleep(self.poll_s)
                continue
            response.raise_for_status()
            batch = orjson.loads(response.content)["batch"]
            if batch:
                return batch
            if time.monotonic() > deadline:
                if budget_first:
                    raise BudgetSpent(f"no batch from {self.http.base_url} before the wall-clock budget ran out")
                raise NoMoreBatches(f"no batch from {self.http.base_url} for {self.max_wait_s:.0f} s")
            time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic()) + 0.01))

    def close(self) -> None:
        self.http.close()


def pack_groups(groups: Iterator[dict[str, Any]], batch_size: int) -> Iterator[list[dict[str, Any]]]:
    """Whole groups in order into batches of exactly `batch_size` sequences; a group that would overflow starts
    the next batch only if it fits there (larger groups are skipped, as the API skips them)."""
    batch: list[dict[str, Any]] = []
    size = 0
    for group in groups:
        n = len(group["tokens"])
        if n > batch_size:
            logger.warning("skipping a group of %d sequences: larger than batch_size %d", n, batch_size)
            continue
        if size + n > batch_size:
            batch, size = [], 0  # Atropos/ours serve exact sizes only; an unfillable tail is dropped here
        batch.append(group)
        size += n
        if size == batch_size:
            yield batch
            batch, size = [], 0


class StoreBatchSource:
    """Batches packed from store runs in commit order (offline training)."""

    def __init__(self, store_root: str, runs: list[str], *, batch_size: int) -> None:
        if not runs:
            raise ValueError("source.runs is empty: name the store runs to train on (source.kind=store)")
        self.store, self.runs, self.batch_size = ShardStore(store_root), runs, batch_size
        self._batches: Iterator[list[dict[str, Any]]] | None = None

    def _groups(self) -> Iterator[dict[str, Any]]:
        for run in self.runs:
            for group in self.store.iter_groups(run):
                yield {**group.wire_dict(), "policy_version": group.policy_version}

    def start(self, step: int) -> None:
        self._batches = pack_groups(self._groups(), self.batch_size)
        for _ in range(step):
            if next(self._batches, None) is None:
                break

    def next_batch(self, until: float | None = None) -> list[dict[str, Any]]:
        """The next full batch of the store (`until` is not used: a store never waits)."""
        if self._batches is None:
            self.start(0)
        batch = next(self._batches, None)  # type: ignore[arg-type]
        if batch is None:
            raise NoMoreBatches(f"store runs {self.runs} have no more full batches")
        return batch

    def close(self) -> None:
        pass
