"""No cyclic garbage collection while a bulk load builds objects that stay alive (a store's records, parsed stats).

CPython runs a collection every 700 net allocations of tracked objects and each one walks what survived, so a
start-up, a compaction or a viewer's first look that keeps an object or more per shard or chunk spent much of its
time collecting and freed nothing (run-api 4.4 s of a 13 s start-up at 300k shards; the viewer ~70% of a 20k-chunk
first look; compaction ~6% at 100k shards: bench/RESULTS.md, issue 34). Objects are still freed by their reference
counts meanwhile; only cyclic garbage waits until the pause ends. Process-wide: other threads' too.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Cyclic collection off for the block, back on after it if it was on before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
