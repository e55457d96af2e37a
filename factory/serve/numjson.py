"""numjson.c through ctypes: JSON number arrays into numpy buffers, with the GIL released.

The C file is compiled once per machine (and per change to it) into the user's cache directory with the
system C compiler. Without a compiler, or with FACTORY_NATIVE_JSON=0, `available()` is False and callers use
their pure-Python path; nothing else changes.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("numjson.c")
_FULL = -2  # numjson.c's NJ_FULL (NJ_ERROR, -1: not numbers it takes)
_library: ctypes.CDLL | None = None
_loaded = False


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollout-factory"


def _build() -> ctypes.CDLL | None:
    source = _SOURCE.read_bytes()
    tag = hashlib.sha256(source + f"{sys.platform}-{platform.machine()}".encode()).hexdigest()[:16]
    target = _cache_dir() / f"numjson-{tag}.so"
    if not target.exists():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            logger.warning("no C compiler found: posted bodies are decoded by the slower pure-Python path")
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            result = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(_SOURCE)],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("compiling %s failed, using the pure-Python path: %s", _SOURCE.name, result.stderr[-500:])
                return None
            os.replace(built, target)  # atomic: processes building at once each install a whole file
    library = ctypes.CDLL(str(target))
    library.nj_read_2d.restype = ctypes.c_long
    library.nj_read_2d.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                   ctypes.POINTER(ctypes.c_size_t)]
    return library


def _get() -> ctypes.CDLL | None:
    global _library, _loaded
    if not _loaded:
        _loaded = True
        if os.environ.get("FACTORY_NATIVE_JSON", "1") != "0":
            try:
                _library = _build()
            except OSError as error:
                logger.warning("cannot build or load %s (%s): using the pure-Python path", _SOURCE.name, error)
    return _library


def available() -> bool:
    return _get() is not None


def read_2d(text: bytes, integers: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """`[[1,2],[3]]` as (values, lengths per inner list), e.g. ([1, 2, 3], [2, 1]): int32 with `integers`,
    else float64. None when the text is not a JSON array of arrays of numbers that fit (int32: integers only,
    in range; float64: finite)."""
    library = _get()
    assert library is not None, "numjson is not available"
    # Every number takes at least one character and one separator, every inner array two brackets.
    capacity = len(text) // 2 + 1
    lengths = np.empty(capacity, dtype=np.int32)
    count = ctypes.c_size_t(0)
    if integers:
        values = np.empty(capacity, dtype=np.int32)
        rows = library.nj_read_2d(text, len(text), 1, values.ctypes.data, None, None, capacity,
                                  lengths.ctypes.data, capacity, ctypes.byref(count))
    else:
        chars = np.empty(len(text), dtype=np.uint8)
        offsets = np.empty(capacity + 1, dtype=np.int32)
        rows = library.nj_read_2d(text, len(text), 0, None, chars.ctypes.data, offsets.ctypes.data, capacity,
                                  lengths.ctypes.data, capacity, ctypes.byref(count))
    if rows < 0:
        if rows == _FULL:  # pragma: no cover - the capacities above are upper bounds
            raise AssertionError("numjson buffer bound was wrong")
        return None
    n = count.value
    if integers:
        return values[:n].copy(), lengths[:rows].copy()  # copies: the buffers above are oversized
    texts = pa.StringArray.from_buffers(n, pa.py_buffer(offsets[: n + 1]), pa.py_buffer(chars[: offsets[n]]))
    floats = pc.cast(texts, pa.float64()).to_numpy()  # Arrow's parser: correctly rounded, without the GIL
    if not np.isfinite(floats).all():
        return None
    return floats, lengths[:rows].copy()
