"""Histograms and the dedup set stay small however much goes through them."""

from __future__ import annotations

import random

from factory.export.stats import DedupSet, ScoreHistogram


def test_histogram_counts_everything_and_widens_its_buckets():
    histogram = ScoreHistogram()
    rng = random.Random(1)
    values = [rng.uniform(-1000, 1000) for _ in range(20000)]
    histogram.add(values)
    assert len(histogram.counts) <= 4096 and histogram.step > 0.01
    bins = histogram.bins(10)
    assert len(bins) <= 10 and sum(n for *_, n in bins) == 20000
    assert bins[0][0] <= min(values) and bins[-1][1] >= max(values)


def test_dedup_set_across_flushes():
    seen = DedupSet(flush_at=100)
    assert all(seen.add(v) for v in range(1000))
    assert not any(seen.add(v) for v in range(0, 1000, 7))
    assert seen.add(-5) and len(seen) == 1001
    assert seen.sorted.nbytes <= 8 * 1001
