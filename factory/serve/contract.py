"""What the API answers with before any rows exist: error types, field names, content negotiation.

Nothing here imports pyarrow or numpy: an idle run-api (registered, nothing queued) loads neither (idle RSS);
the row-building modules (wire.py, payload.py, ingest.py, the store) are imported on the first post or read.
"""

from __future__ import annotations

from typing import Any

ARROW_STREAM = "application/vnd.apache.arrow.stream"
"""The media type of an Arrow IPC stream (factory.schema's ARROW_STREAM; kept here to spare importing pyarrow)."""

JSON_TEXT_FIELDS = ("messages", "generation_params", "overrides", "group_overrides", "images")
# Per-sequence fields whose length (and per-token length) Atropos does not check against `tokens`.
SEQUENCE_FIELDS = ("masks", "scores", "advantages", "ref_logprobs", "inference_logprobs", "messages", "overrides",
                   "distill_token_ids", "distill_logprobs")
TOKEN_FIELDS = ("masks", "advantages", "ref_logprobs", "inference_logprobs", "distill_token_ids", "distill_logprobs")


class WireError(ValueError):
    """A body Atropos would refuse too: `detail` is FastAPI-style 422 detail naming the field."""

    def __init__(self, detail: list[dict[str, Any]]) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, d['loc']))}: {d['msg']}" for d in detail))
        self.detail = detail


class PayloadError(RuntimeError):
    """A queued group's shard could not be read; the message names the shard (`path`, where known)."""

    def __init__(self, message: str, path: object = None) -> None:
        super().__init__(message)
        self.path = path


def prefers_arrow(accept: str) -> bool:
    """Whether an Accept header asks for ARROW_STREAM at least as much as for JSON (q > 0); JSON otherwise."""
    quality = {}
    for part in accept.split(","):
        media, *params = (piece.strip() for piece in part.split(";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        quality[media.lower()] = max(q, quality.get(media.lower(), 0.0))
    arrow = quality.get(ARROW_STREAM, 0.0)
    return arrow > 0 and arrow >= quality.get("application/json", 0.0)
