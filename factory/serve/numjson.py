"""numjson.c through ctypes: the number lists of posted bodies into numpy buffers, with the GIL released.

numjson.c is built when the package is installed (setup.py: the optional extension `factory.serve._numjson`,
a plain shared library that ctypes loads; nothing is compiled at run time). Where it was not built (no C
compiler at install time), or with FACTORY_NATIVE_JSON=0, `available()` is False and callers use msgspec
alone; nothing else changes. It is kept because it measured at least 1.3x msgspec's end-to-end ingest on
Atropos's harness (bench/RESULTS.md, issue 29).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

logger = logging.getLogger(__name__)

_FULL = -2  # numjson.c's NJ_FULL (NJ_ERROR, -1: not numbers it takes)
_library: ctypes.CDLL | None = None
_loaded = False


def built_library() -> Path | None:
    """The shared library setup.py built from numjson.c next to this file, if there is one."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_numjson{suffix}"
        if candidate.is_file():
            return candidate
    return None


def _load() -> ctypes.CDLL | None:
    path = built_library()
    if path is None:
        logger.warning("factory/serve/_numjson was not built at install time (no C compiler?): posted bodies are "
                       "decoded by msgspec alone (slower); reinstall with a C compiler to build it")
        return None
    library = ctypes.CDLL(str(path))
    library.nj_read_body.restype = ctypes.c_long
    library.nj_read_body.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                                     ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                     ctypes.c_void_p]
    return library


def _get() -> ctypes.CDLL | None:
    global _library, _loaded
    if not _loaded:
        _loaded = True
        if os.environ.get("FACTORY_NATIVE_JSON", "1") != "0":
            try:
                _library = _load()
            except OSError as error:
                logger.warning("cannot load the built numjson library (%s): posted bodies are decoded by msgspec alone", error)
    return _library


def available() -> bool:
    return _get() is not None


def _float_cast() -> Callable[[pa.Array], pa.Array]:
    """Arrow's string-to-float64 cast, called without importing `pyarrow.compute`.

    That module builds a Python wrapper with a docstring for each of Arrow's ~300 functions when it is imported
    (pydoc and all): ~20 ms of CPU and ~1.4 MiB of RSS on the run-api's first post, kept for the process's life, to
    reach one function. The cast is the same function (`call_function("cast")`, what `pc.cast` calls) in
    pyarrow's own `_compute` module; a pyarrow without that private name gets the public one."""
    try:
        from pyarrow._compute import CastOptions, call_function
    except ImportError:  # pragma: no cover - pyarrow moved its private module
        import pyarrow.compute as pc

        return lambda texts: pc.cast(texts, pa.float64())
    options = CastOptions.safe(pa.float64())
    return lambda texts: call_function("cast", [texts], options)


_cast_floats: Callable[[pa.Array], pa.Array] | None = None


SCRATCH_MIN_BYTES = 1 << 20
"""Bodies of at least this size are read into buffers kept between calls (`drop_scratch` lets them go)."""
_scratch: list[np.ndarray] | None = None
_scratch_lock = threading.Lock()


def _buffers(size: int) -> list[np.ndarray]:
    """Output buffers for a body of `size` bytes: upper bounds of what numjson.c writes (it checks them)."""
    capacity, record_capacity = size // 2 + 1, size // 4 + 1
    return [np.empty(size, dtype=np.uint8), np.empty(capacity, dtype=np.int32), np.empty(size, dtype=np.uint8),
            np.empty(capacity + 1, dtype=np.int32), np.empty(capacity, dtype=np.int32),
            np.empty((record_capacity, 4), dtype=np.int32)]


def _scratch_buffers(size: int) -> list[np.ndarray]:
    """The kept buffers (under `_scratch_lock`), grown to fit `size`.

    Fresh buffers for a big body are new mappings (above glibc's mmap threshold) whose pages fault in as
    numjson.c writes them, and are unmapped after: on a 14 MB body of 64 groups ~10 MB of them. Only the pages
    a body touched are resident, so what is kept is about what the biggest recent body wrote."""
    global _scratch
    scratch = _scratch
    if scratch is None or len(scratch[0]) < size:
        scratch = _scratch = _buffers(size + size // 8)
    return scratch


def drop_scratch() -> None:
    """Let the kept buffers go (any thread; a read using them keeps its own reference until it ends)."""
    global _scratch
    _scratch = None


FIELDS = ("tokens", "masks", "advantages", "ref_logprobs", "inference_logprobs")
"""The number-list fields `read_body` reads, in numjson.c's order; the first two are integers."""


def read_body(body: bytes | bytearray | memoryview, many: bool
              ) -> tuple[bytes, list[dict[str, tuple[np.ndarray, np.ndarray]]]] | None:
    """A /scored_data body (`many`: a list of objects) read in one pass: (the body with every number-list field
    it read replaced by [], and per object the fields it read as (values, lengths per inner list), int32 for
    tokens and masks, float64 for the others). Fields that are not arrays of arrays of plain numbers (null,
    say) are left in the body. None when the body is not something it takes (see numjson.c): the caller's
    general decoder decides then. `body` is read in place: bytes, or a view of a reused buffer."""
    library = _get()
    assert library is not None, "numjson is not available"
    text = np.frombuffer(body, dtype=np.uint8)  # its address, without a copy
    size = len(text)
    capacity = size // 2 + 1
    record_capacity = size // 4 + 1
    reused = size >= SCRATCH_MIN_BYTES and _scratch_lock.acquire(blocking=False)
    try:
        buffers = _scratch_buffers(size) if reused else _buffers(size)
        return _read(library, text, many, buffers, capacity, record_capacity)
    finally:
        if reused:
            _scratch_lock.release()


def _read(library: ctypes.CDLL, text: np.ndarray, many: bool, buffers: list[np.ndarray], capacity: int,
          record_capacity: int) -> tuple[bytes, list[dict[str, tuple[np.ndarray, np.ndarray]]]] | None:
    """read_body into `buffers` (stripped, values, chars, offsets, lengths, records); what it returns is copied
    out of them."""
    size = len(text)
    stripped, values, chars, offsets, lengths, records = buffers
    stripped_size = ctypes.c_size_t(0)
    counts = (ctypes.c_size_t * 4)()
    groups = library.nj_read_body(text.ctypes.data, size, int(many), stripped.ctypes.data, ctypes.byref(stripped_size),
                                  values.ctypes.data, chars.ctypes.data, offsets.ctypes.data, capacity,
                                  lengths.ctypes.data, capacity, records.ctypes.data, record_capacity, counts)
    if groups < 0:
        if groups == _FULL:  # pragma: no cover - the capacities above are upper bounds
            raise AssertionError("numjson buffer bound was wrong")
        return None
    n_integers, n_floats, _, n_records = counts
    floats = np.empty(0)
    if n_floats:
        texts = pa.StringArray.from_buffers(n_floats, pa.py_buffer(offsets[: n_floats + 1]),
                                            pa.py_buffer(chars[: offsets[n_floats]]))
        global _cast_floats
        if _cast_floats is None:
            _cast_floats = _float_cast()
        parsed = _cast_floats(texts)  # Arrow's parser: correctly rounded, without the GIL
        # The values buffer as numpy directly: Array.to_numpy() imports pandas (~35 MiB RSS and ~1 s of CPU on the
        # first post after start).
        floats = np.frombuffer(parsed.buffers()[1], dtype=np.float64, count=len(parsed), offset=parsed.offset * 8)
        if not np.isfinite(floats).all():
            return None
    integers = values[:n_integers].copy()  # copies: the buffers above are oversized
    row_lengths = lengths[: counts[2]].copy()
    fields: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(groups)]
    at_integer = at_float = at_length = 0
    for group, field, rows, numbers in records[:n_records].tolist():
        if field < 2:
            read, at_integer = integers[at_integer : at_integer + numbers], at_integer + numbers
        else:
            read, at_float = floats[at_float : at_float + numbers], at_float + numbers
        fields[group][FIELDS[field]] = (read, row_lengths[at_length : at_length + rows])
        at_length += rows
    return stripped[: stripped_size.value].tobytes(), fields
