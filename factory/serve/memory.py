"""glibc malloc settings of the service, without pyarrow: set at start, before any worker thread allocates."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 1 << 20
"""Blocks of this size or more are mapped on their own and unmapped when freed (glibc's default starts at 128 KiB
and rises to the largest block freed so far, up to 32 MiB, after which /batch bodies and row groups are carved from
the heap and stay resident once freed)."""
ARROW_POOL_ENV = "ARROW_DEFAULT_MEMORY_POOL"


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


LIBC = _libc()


def limit_malloc_arenas() -> bool:
    """Two malloc arenas at most (decoding and commit threads otherwise each keep their own high-water mark), a
    fixed mmap threshold, and Arrow's C++ allocations in that same malloc. Arenas made before this call stay, so
    it is called first thing at start. False where there is no glibc.

    `pa.set_memory_pool` only changes the pool pyarrow's Python functions use; Arrow's C++ code (the Parquet
    writer, among others) keeps allocating from its default pool, mimalloc in pyarrow 26, which reserves a 1 GiB
    region and kept 60-70 MiB of it resident after a drain (bench.serve.drain_rss). That default is read from
    ARROW_DEFAULT_MEMORY_POOL when Arrow first allocates, so it is set here, before pyarrow is loaded (a value the
    user set is kept)."""
    if LIBC is None:
        return False
    os.environ.setdefault(ARROW_POOL_ENV, "system")
    LIBC.mallopt(_M_ARENA_MAX, 2)
    LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)  # setting it also fixes the trim threshold (2x)
    LIBC.mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_BYTES)
    return True


def return_free_memory() -> None:
    """Give freed heap pages back to the OS (glibc), e.g. after a commit freed a batch of decoded groups."""
    if LIBC is not None:
        LIBC.malloc_trim(0)
