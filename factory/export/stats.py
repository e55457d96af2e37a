"""What an export did: rows in and out, drops by reason, score histograms; and the bounded dedup set.

Memory stays flat in the input: histograms keep counts per rounded score
(coarsened when too many distinct values appear), and the dedup set keeps
8 bytes per written row in a sorted numpy array.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

_MAX_BUCKETS = 4096


class ScoreHistogram:
    """Streaming histogram of scores: exact counts per bucket of width `step`, widened as needed."""

    def __init__(self, step: float = 0.01) -> None:
        self.step = step
        self.counts: Counter[int] = Counter()
        self.total = 0

    def add(self, scores: list[float]) -> None:
        step = self.step
        for score in scores:
            self.counts[math.floor(score / step)] += 1
        self.total += len(scores)
        if len(self.counts) > _MAX_BUCKETS:
            self._widen()

    def add_one(self, score: float) -> None:
        self.counts[math.floor(score / self.step)] += 1
        self.total += 1
        if len(self.counts) > _MAX_BUCKETS:
            self._widen()

    def _widen(self) -> None:
        while len(self.counts) > _MAX_BUCKETS:
            merged: Counter[int] = Counter()
            for bucket, count in self.counts.items():
                merged[bucket // 10] += count
            self.counts, self.step = merged, self.step * 10

    def bins(self, max_bins: int = 20) -> list[tuple[float, float, int]]:
        """(low, high, count) over the observed range, at most `max_bins` equal-width bins."""
        if not self.counts:
            return []
        low_bucket, high_bucket = min(self.counts), max(self.counts)
        span = high_bucket - low_bucket + 1
        per_bin = max(1, math.ceil(span / max_bins))
        out: list[tuple[float, float, int]] = []
        for start in range(low_bucket, high_bucket + 1, per_bin):
            count = sum(self.counts.get(b, 0) for b in range(start, start + per_bin))
            out.append((round(start * self.step, 6), round((start + per_bin) * self.step, 6), count))
        return out


class DedupSet:
    """Set of 64-bit content hashes: a sorted numpy array plus a small buffer of recent ones."""

    def __init__(self, flush_at: int = 65536) -> None:
        import numpy as np  # here, not at import: only exports that deduplicate need it (the CLIs' start-up)

        self._np = np
        self.sorted = np.empty(0, dtype=np.int64)
        self.recent: set[int] = set()
        self.flush_at = flush_at

    def add(self, value: int) -> bool:
        """Add `value`; False if it was already present."""
        if value in self.recent:
            return False
        np = self._np
        index = int(np.searchsorted(self.sorted, value))
        if index < len(self.sorted) and self.sorted[index] == value:
            return False
        self.recent.add(value)
        if len(self.recent) >= self.flush_at:
            new = np.fromiter(self.recent, dtype=np.int64, count=len(self.recent))
            new.sort()
            # np.insert makes one new array; union1d would make about four (peak memory).
            self.sorted = np.insert(self.sorted, np.searchsorted(self.sorted, new), new)
            self.recent.clear()
        return True

    def __len__(self) -> int:
        return len(self.sorted) + len(self.recent)


@dataclass
class ExportStats:
    """Counts of one export, for logs, the CLI and the Prefect summary artifact."""

    kind: str
    groups_in: int = 0
    rows_in: int = 0
    rows_out: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    scores_in: ScoreHistogram = field(default_factory=ScoreHistogram)
    scores_out: ScoreHistogram = field(default_factory=ScoreHistogram)
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "groups_in": self.groups_in,
            "rows_in": self.rows_in,
            "rows_out": self.rows_out,
            "dropped": dict(sorted(self.dropped.items())),
            "score_histogram_in": self.scores_in.bins(),
            "score_histogram_out": self.scores_out.bins(),
            "seconds": round(self.seconds, 3),
            "rows_out_per_s": round(self.rows_out / self.seconds, 1) if self.seconds else None,
            "outputs": self.outputs,
        }

    def markdown(self) -> str:
        unit = "pairs" if self.kind == "dpo" else "rows"
        lines = [
            f"# {self.kind.upper()} export",
            "",
            "| groups in | sequences in | " + unit + " out | seconds |",
            "|---:|---:|---:|---:|",
            f"| {self.groups_in} | {self.rows_in} | {self.rows_out} | {self.seconds:.1f} |",
            "",
            "## Sequences dropped, by reason",
            "",
            "| reason | count |",
            "|---|---:|",
            *(f"| {reason} | {count} |" for reason, count in sorted(self.dropped.items())),
            "",
            "## Score histogram (sequences in / " + unit + " out)",
            "",
            "| score range | in | out |",
            "|---|---:|---:|",
        ]
        out_counts = {(lo, hi): n for lo, hi, n in self.scores_out.bins(1_000_000)}
        for low, high, count in self.scores_in.bins():
            if not count:
                continue
            kept = sum(n for (lo, hi), n in out_counts.items() if low <= lo and hi <= high + 1e-9)
            lines.append(f"| [{low:g}, {high:g}) | {count} | {kept} |")
        lines += ["", "Outputs: " + ", ".join(f"`{p}`" for p in self.outputs)]
        return "\n".join(lines)
