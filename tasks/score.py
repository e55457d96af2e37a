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

import atexit
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

from prefect import task
from prefect.cache_policies import NO_CACHE

from environments.base import EnvSpec, Item, Rollout, load_env
from tasks.generate import GeneratedChunk

logger = logging.getLogger(__name__)


class _ScoreTimeout(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _ScoreTimeout()


def score_item(spec: EnvSpec, item: Item, texts: Sequence[str], timeout_s: float | None) -> list[float | str]:
    """Scores for one item's completions; a string in place of a score is the error that happened."""
    env = load_env(spec, setup=False)
    use_alarm = timeout_s is not None and threading.current_thread() is threading.main_thread()
    if use_alarm:
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    results: list[float | str] = []
    try:
        for text in texts:
            try:
                results.append(float(env.score(item, text)))
            except _ScoreTimeout:
                raise
            except Exception as error:  # a bad completion must not take the chunk down
                results.append(f"score_error: {type(error).__name__}: {error}"[:300])
    except _ScoreTimeout:
        results += ["score_timeout"] * (len(texts) - len(results))
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return results


class ScorerPool:
    """A process pool shared by every chunk scored in this process (forkserver: safe beside threads)."""

    _lock = threading.Lock()
    _pools: dict[int, Any] = {}

    @classmethod
    def get(cls, workers: int) -> Any:
        with cls._lock:
            pool = cls._pools.get(workers)
            if pool is None:
                context = multiprocessing.get_context("forkserver")
                pool = cls._pools[workers] = context.Pool(workers)
            return pool

    @classmethod
    def discard(cls, workers: int) -> None:
        with cls._lock:
            pool = cls._pools.pop(workers, None)
        if pool is not None:
            pool.terminate()

    @classmethod
    def close_all(cls) -> None:
        with cls._lock:
            pools, cls._pools = list(cls._pools.values()), {}
        for pool in pools:
            pool.terminate()


atexit.register(ScorerPool.close_all)


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
    """Fill in `score` (or `error`) on every rollout of the chunk; rollouts that already failed are left alone."""
    todo = [(i, [r for r in group if r.error is None]) for i, group in enumerate(rollouts)]
    if mode == "inline":
        for i, live in todo:
            _apply(live, score_item(spec, items[i], [r.text for r in live], None))
        return [list(group) for group in rollouts]
    pool = ScorerPool.get(workers)
    pending = [(live, pool.apply_async(score_item, (spec, items[i], [r.text for r in live], timeout_s))) for i, live in todo]
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


score_task = task(
    score_generated, name="score", task_run_name="score-chunk", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE
)
