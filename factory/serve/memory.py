"""glibc malloc settings of the service, without pyarrow: set at start, before any worker thread allocates."""

from __future__ import annotations

import ctypes
import ctypes.util

_M_ARENA_MAX = -8


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


LIBC = _libc()


def limit_malloc_arenas() -> bool:
    """Two malloc arenas at most (decoding and commit threads otherwise each keep their own high-water mark).
    Arenas made before this call stay, so it is called first thing at start. False where there is no glibc."""
    if LIBC is None:
        return False
    LIBC.mallopt(_M_ARENA_MAX, 2)
    return True


def return_free_memory() -> None:
    """Give freed heap pages back to the OS (glibc), e.g. after a commit freed a batch of decoded groups."""
    if LIBC is not None:
        LIBC.malloc_trim(0)
