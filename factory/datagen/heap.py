"""A datagen worker's garbage collector: the heap it starts with, frozen once, is left out of full collections.

A worker process imports transformers, pyarrow, pydantic and Prefect and loads a tokenizer before its first chunk:
some 300,000 tracked objects that live as long as the process. Every full (oldest-generation) collection walked
all of them again, ~150 ms each, about one per thousand groups on the bench's instant server: ~25% of the
worker's CPU (issue 33, bench/RESULTS.md). `gc.freeze()` moves them to the permanent generation, so a full
collection walks only what the chunks made. Reference counting still frees frozen objects; only reference
cycles among them are never collected (hence one collection right before freezing).
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_frozen = False


def freeze_startup_heap() -> bool:
    """Collect, then freeze every object alive now, once per process (later calls do nothing); True if this
    call froze. Call it when the process's long-lived state is loaded (environment, tokenizer, clients)."""
    global _frozen
    with _lock:
        if _frozen:
            return False
        gc.collect()
        gc.freeze()
        _frozen = True
        return True
