"""A datagen worker's garbage collector: the heap it starts with, frozen once, is left out of full collections; the
young generations are collected less often.

A worker process imports transformers, pyarrow, pydantic and Prefect and loads a tokenizer before its first chunk:
some 300,000 tracked objects that live as long as the process. Every full (oldest-generation) collection walked
all of them again, ~150 ms each, about one per thousand groups on the bench's instant server: ~25% of the
worker's CPU (issue 33, bench/RESULTS.md). `gc.freeze()` moves them to the permanent generation, so a full
collection walks only what the chunks made. Reference counting still frees frozen objects; only reference
cycles among them are never collected (hence one collection right before freezing).

What the chunks make (rollouts, token lists, groups: some 100-200 tracked containers per group) lives until its
chunk is committed and holds no reference cycles, so the young collections CPython runs every 700 net allocations
walked it two or three times and freed nothing: a plain worker's 1000 groups ran ~130 generation-0, 12 generation-1
and 1 full pass, 0 objects collected by the young ones, 60-65 ms of CPU (~60 us per group, issue 33). With the first
threshold at `YOUNG_THRESHOLD` a chunk's data is freed by reference counting at its commit before any pass sees it
(the same 1000 groups ran no pass at all); cycles that do form are still collected, later.
"""

from __future__ import annotations

import gc
import threading

YOUNG_THRESHOLD = 50_000
"""Generation-0 threshold of a datagen worker (CPython's default: 700): net allocations of tracked objects between
young collections."""

_lock = threading.Lock()
_frozen = False


def freeze_startup_heap() -> bool:
    """Collect, then freeze every object alive now, and raise the young generation's threshold to
    `YOUNG_THRESHOLD` (never lowering one set higher), once per process (later calls do nothing); True if this
    call froze. Call it when the process's long-lived state is loaded (environment, tokenizer, clients)."""
    global _frozen
    with _lock:
        if _frozen:
            return False
        gc.collect()
        gc.freeze()
        young, middle, old = gc.get_threshold()
        if young and young < YOUNG_THRESHOLD:  # 0: collection turned off by the process, left so
            gc.set_threshold(YOUNG_THRESHOLD, middle, old)
        _frozen = True
        return True
