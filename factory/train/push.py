"""Push a checkpoint to SGLang-compatible inference endpoints and check they serve it as the new policy version."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)


class WeightPushError(RuntimeError):
    """An endpoint refused or did not confirm a checkpoint; the message names it."""


def push_weights(endpoints: list[str], checkpoint: str | Path, version: int, *, timeout_s: float = 120.0) -> float:
    """POST /update_weights_from_disk to every endpoint with weight_version=`version`; returns seconds taken."""
    started = time.perf_counter()
    path = str(Path(checkpoint).resolve())
    with httpx.Client(timeout=timeout_s) as http:
        for root in endpoints:
            root = root.rstrip("/").removesuffix("/v1")
            try:
                response = http.post(f"{root}/update_weights_from_disk",
                                     json={"model_path": path, "weight_version": str(version)})
            except httpx.HTTPError as error:
                raise WeightPushError(f"{root}: pushing {path} failed: {type(error).__name__}: {error}") from error
            data = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
            if response.status_code != 200 or data.get("success") is False:
                raise WeightPushError(f"{root}: pushing {path} refused: HTTP {response.status_code}: {response.text[:300]}")
            reported = http.get(f"{root}/get_weight_version").json().get("weight_version")
            if str(reported) != str(version):
                raise WeightPushError(f"{root} reports weight version {reported} after loading version {version}")
    seconds = time.perf_counter() - started
    logger.info("pushed %s as version %d to %d endpoint(s) in %.2fs", path, version, len(endpoints), seconds)
    return seconds


class BackgroundPusher:
    """One push in flight at a time on a worker thread, so the trainer keeps training while a server loads weights.

    The server loads a pushed checkpoint between generation batches (its queue keeps order), so a synchronous push
    makes the trainer wait for the batches queued before the load; here only `wait()` (before the next push, before
    pruning the checkpoint being loaded, at the end) blocks, and a failed push is raised there.
    """

    def __init__(self, endpoints: list[str], *, timeout_s: float = 120.0) -> None:
        self.endpoints = endpoints
        self.timeout_s = timeout_s
        self.pushes = 0
        self.push_s = 0.0  # seconds the pushes took on the worker thread (not seconds the trainer waited)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, checkpoint: str | Path, version: int) -> float:
        """Wait for the previous push, start this one; returns the seconds the caller waited."""
        waited = self.wait()
        self._thread = threading.Thread(target=self._push, args=(checkpoint, version), name="weight-push", daemon=True)
        self._thread.start()
        return waited

    def wait(self) -> float:
        """Block until the push in flight (if any) is done; re-raise its error. Returns the seconds waited."""
        began = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return time.perf_counter() - began

    def _push(self, checkpoint: str | Path, version: int) -> None:
        try:
            self.push_s += push_weights(self.endpoints, checkpoint, version, timeout_s=self.timeout_s)
            self.pushes += 1
        except BaseException as error:  # noqa: BLE001 - handed to the trainer thread in wait()
            self._error = error
