"""Which sequences of a group become SFT rows, and which pairs become DPO rows.

The rules follow Atropos's sft/dpo generators, with the order made explicit:

SFT: rank sequences by score, best first (ties keep their order in the group);
drop those too long or too short, below `min_score`, not positive (unless
negatives are allowed), or not more than `min_score_diff_max_min` above the
group's lowest score. The caller takes the first `top_n_per_group` of what is
left, skipping duplicates.

DPO: chosen candidates are ranked as above; the rejected pool is the
`pairs_per_group` lowest-scoring sequences. For each of the first
`pairs_per_group` chosen, one rejected that scores more than
`min_score_diff_max_min` below it is drawn at random (seeded per group) and
removed from the pool, so each rejected is used once.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from factory.export.config import DpoSelectionConfig, SelectionConfig

TOO_LONG = "too_long"
TOO_SHORT = "completion_too_short"
BELOW_MIN = "below_min_score"
NOT_POSITIVE = "not_positive_score"
SPREAD = "within_min_score_diff_of_group_min"
TOP_N = "beyond_top_n"
DUPLICATE = "duplicate"
LIMIT = "over_limit"
NO_PAIR = "no_rejected_with_gap"
UNPAIRED = "unpaired"
UNRENDERABLE = "unrenderable"
MULTIMODAL_SKIPPED = "multimodal_needs_output_images"  # a sequence with images, left out without output.images


def _length_reason(index: int, seq_lens: list[int], completion_lens: list[int], select: SelectionConfig) -> str | None:
    if select.max_token_len is not None and seq_lens[index] > select.max_token_len:
        return TOO_LONG
    if completion_lens[index] < select.min_completion_tokens:
        return TOO_SHORT
    return None


def rank_sft(
    scores: list[float], seq_lens: list[int], completion_lens: list[int], select: SelectionConfig
) -> tuple[list[int], Counter[str]]:
    """Indices of the eligible sequences, best first, and the drop count per reason of the rest."""
    dropped: Counter[str] = Counter()
    group_min = min(scores)
    check_lengths = select.max_token_len is not None or select.min_completion_tokens > 0
    kept = []
    for index in sorted(range(len(scores)), key=scores.__getitem__, reverse=True):
        score = scores[index]
        reason = _length_reason(index, seq_lens, completion_lens, select) if check_lengths else None
        if reason is None:
            if select.min_score is not None and score < select.min_score:
                reason = BELOW_MIN
            elif not select.allow_negative_scores and score <= 0:
                reason = NOT_POSITIVE
            elif select.min_score_diff_max_min > 0 and score - group_min <= select.min_score_diff_max_min:
                reason = SPREAD
        if reason is None:
            kept.append(index)
        else:
            dropped[reason] += 1
    return kept, dropped


@dataclass(frozen=True)
class Pair:
    chosen: int
    rejected: int


def pair_dpo(
    scores: list[float],
    seq_lens: list[int],
    completion_lens: list[int],
    select: DpoSelectionConfig,
    group_id: str,
) -> tuple[list[Pair], Counter[str]]:
    """Chosen/rejected pairs of one group, best chosen first, and why sequences took part in none.

    Drops are counted per sequence that is in no pair, under the first rule
    that kept it out: its length, its score as a chosen candidate, or
    `no_rejected_with_gap` when no rejected scored far enough below it.
    """
    dropped: Counter[str] = Counter()
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    fits = [i for i in order if _length_reason(i, seq_lens, completion_lens, select) is None]
    chosen_candidates = []
    reasons: dict[int, str] = {}
    for index in order:
        reason = _length_reason(index, seq_lens, completion_lens, select)
        if reason is None:
            if select.min_score is not None and scores[index] < select.min_score:
                reason = BELOW_MIN
            elif not select.allow_negative_scores and scores[index] <= 0:
                reason = NOT_POSITIVE
        if reason is None:
            chosen_candidates.append(index)
        else:
            reasons[index] = reason
    pool = sorted(fits, key=lambda i: scores[i])[: select.pairs_per_group]
    rng = random.Random(f"{select.seed}:{group_id}")
    pairs = []
    for chosen in chosen_candidates[: select.pairs_per_group]:
        eligible = [r for r in pool if scores[r] < scores[chosen] - select.min_score_diff_max_min]
        if not eligible:
            reasons.setdefault(chosen, NO_PAIR)
            continue
        rejected = rng.choice(eligible)
        pool.remove(rejected)
        pairs.append(Pair(chosen, rejected))
    used = {p.chosen for p in pairs} | {p.rejected for p in pairs}
    for index in range(len(scores)):
        if index not in used:
            dropped[reasons.get(index, UNPAIRED)] += 1
    return pairs, dropped
