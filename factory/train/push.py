"""Push a checkpoint to SGLang-compatible inference endpoints and check they serve it as the new policy version."""

from __future__ import annotations

import logging
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
