"""Score rollouts: CPU-bound, in parallel scorer processes, with a per-item timeout.

Each item's completions are scored in one call inside a worker process of a
long-lived pool (started once per process, reused by every chunk). The
timeout is enforced inside the worker with a real-time alarm, so a scorer
stuck in Python code (a runaway sympy simplification) costs one item, not the
chunk: its rollouts get `error="score_timeout"` and the group is dropped as
`failed`. A scorer that raises gets `error="score_error: …"`. As a last line
of defence, a chunk whose results do not arrive within a generous deadline
has its pool torn down and rebuilt. `mode="inline"` scores in the calling
thread (for cheap scorers, no timeout).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Sequence
from typing import Literal

from environments.base import EnvSpec, Item, Rollout
from tasks.generate import GeneratedChunk
from tasks.scoring_pool import ScorerPool, score_item

logger = logging.getLogger(__name__)


def _apply(rollouts: Sequence[Rollout], results: Sequence[float | str]) -> None:
    for rollout, result in zip(rollouts, results):
        if isinstance(result, str):
            rollout.error = result
        else:
            rollout.score = result


def score_chunk(
    spec: EnvSpec,
    items: Sequence[Item],
    rollouts: Sequence[Sequence[Rollout]],
    *,
    timeout_s: float = 10.0,
    workers: int = 2,
    mode: Literal["process", "inline"] = "process",
) -> list[list[Rollout]]:
    """Fill in `score` (or `error`) on every rollout of the chunk; rollouts that already failed, or that the env
    scored while collecting (an LLM judge), are left alone."""
    todo = [(i, [r for r in group if r.error is None and r.score is None]) for i, group in enumerate(rollouts)]
    if mode == "inline":
        for i, live in todo:
            _apply(live, score_item(spec, items[i], [r.scoring_input() for r in live], None))
        return [list(group) for group in rollouts]
    pool = ScorerPool.get(workers)
    pending = [(live, pool.apply_async(score_item, (spec, items[i], [r.scoring_input() for r in live], timeout_s))) for i, live in todo]
    deadline = timeout_s * (len(todo) / max(workers, 1) + 2) + 30
    end = time.monotonic() + deadline
    try:
        for live, result in pending:
            _apply(live, result.get(timeout=max(0.1, end - time.monotonic())))
    except multiprocessing.TimeoutError:
        ScorerPool.discard(workers)
        raise RuntimeError(
            f"scoring a chunk of {len(todo)} items took over {deadline:.0f}s despite the {timeout_s}s per-item "
            "timeout (a scorer stuck outside Python?); the scorer pool was restarted, retry the chunk"
        ) from None
    return [list(group) for group in rollouts]


def score_generated(
    spec: EnvSpec,
    chunk: GeneratedChunk,
    *,
    timeout_s: float = 10.0,
    workers: int = 2,
    mode: Literal["process", "inline"] = "process",
) -> GeneratedChunk:
    """`score_chunk` over a generated chunk, returned with scores filled in (the pipeline's score step)."""
    score_chunk(spec, chunk.items, chunk.rollouts, timeout_s=timeout_s, workers=workers, mode=mode)
    return chunk
