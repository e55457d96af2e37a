"""The datagen run's summary: totals over every committed chunk of a producer, plus this session's rates."""

from __future__ import annotations

from collections import Counter
from typing import Any

from factory.chunk_stats import summed
from factory.datagen.store import run_location
from factory.store import ShardStore
from tasks.group import DROP_REASONS


def covered(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start, end) intervals: wall time with at least one chunk in inference."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summarize(store: ShardStore, cfg: Any, seconds: float, session: Counter[str],
              intervals: list[tuple[float, float]]) -> dict[str, Any]:
    """Totals over every committed chunk of this producer (this session and earlier ones)."""
    run, producer = cfg.datagen.run_id, cfg.datagen.producer
    committed = {record.chunk for record in store.committed(run).values() if record.producer == producer}
    totals, dropped = summed(store.run_dir(run), producer, committed)  # per-chunk files and folded segments
    totals["chunks"] = len(committed)
    return {
        "run_id": run,
        "producer": producer,
        "chunks_committed": totals["chunks"],
        "groups_kept": totals["groups_kept"],
        "dropped": {reason: dropped.get(reason, 0) for reason in DROP_REASONS},
        "rollouts": totals["rollouts"],
        "mean_score": (totals["score_sum_milli"] / 1000 / totals["scored"]) if totals["scored"] else None,
        "session_seconds": round(seconds, 3),
        "session_chunks": session["chunks"],
        "session_rollouts_per_s": round(session["rollouts"] / seconds, 2) if seconds else None,
        "session_tokens_per_s": round(session["completion_tokens"] / seconds, 2) if seconds else None,
        "session_groups_per_s": round(session["groups_kept"] / seconds, 2) if seconds else None,
        "inference_share": round(covered(intervals) / seconds, 3) if seconds else None,
        "paused_s": round(session["paused_ms"] / 1000, 2),
        "store": run_location(store, run),
    }
