"""The scorer-process side of scoring: a shared process pool and the function its workers run.

Kept free of Prefect imports so a fresh scorer process starts in a fraction
of a second (forkserver; this module is preloaded in the fork server).
"""

from __future__ import annotations

import atexit
import multiprocessing
import signal
import threading
from collections.abc import Sequence
from typing import Any

from environments.base import EnvSpec, Item, load_env


class _ScoreTimeout(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _ScoreTimeout()


def score_item(spec: EnvSpec, item: Item, texts: Sequence[str | list[dict[str, Any]]],
               timeout_s: float | None) -> list[float | str]:
    """Scores for one item's completions (reply texts, or whole conversations for multi-turn envs); a string in
    place of a score is the error that happened."""
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


def ignore_ctrl_c() -> None:
    """Scorer processes leave Ctrl-C (SIGINT to the terminal's whole process group) to the flow process, which stops
    gracefully and then ends the pool; otherwise every scorer prints a KeyboardInterrupt traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


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
                context.set_forkserver_preload([__name__])
                pool = cls._pools[workers] = context.Pool(workers, initializer=ignore_ctrl_c)
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
