"""Group-relative advantages, with the data's own `advantages` and zeroing overrides honoured.

A group's rewards are centred on the group mean (optionally divided by the
group's std). If the group carries per-token `advantages` (an environment
computed them), those are used as they are. `set_advantage_to_zero` in a
sequence's `overrides` entry, or in `group_overrides`, zeroes that sequence
(or the whole group): it stays in the batch, counted, but teaches nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

ZERO_KEY = "set_advantage_to_zero"


def group_relative(scores: Sequence[float], *, scale: bool = False, eps: float = 1e-6) -> list[float]:
    """score - mean(scores), divided by (population std + eps) when `scale`."""
    if not scores:
        return []
    mean = sum(scores) / len(scores)
    centred = [s - mean for s in scores]
    if not scale:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / (std + eps) for c in centred]


def _truthy(mapping: Any, key: str) -> bool:
    return isinstance(mapping, dict) and bool(mapping.get(key))


def token_advantages(group: dict[str, Any], *, scale: bool = False, eps: float = 1e-6) -> list[list[float]]:
    """Per sequence, one advantage per token of `tokens` (prompt positions included; the mask decides)."""
    tokens = group["tokens"]
    given = group.get("advantages")
    if given is not None:
        rows = [[float(a) for a in row] for row in given]
    else:
        per_sequence = group_relative([float(s) for s in group["scores"]], scale=scale, eps=eps)
        rows = [[a] * len(seq) for a, seq in zip(per_sequence, tokens)]
    if _truthy(group.get("group_overrides"), ZERO_KEY):
        return [[0.0] * len(seq) for seq in tokens]
    overrides = group.get("overrides") or []
    for i, override in enumerate(overrides):
        if _truthy(override, ZERO_KEY):
            rows[i] = [0.0] * len(tokens[i])
    return rows
