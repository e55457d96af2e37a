"""Read queued groups' payloads from their shards and write `/batch` bodies straight from Arrow.

FastAPI's generic encoder walks every token as a Python object; here each
sequence is a zero-copy numpy view of the Arrow column, serialised by orjson,
and JSON-text fields (messages, overrides, ...) are spliced in as stored.
Row groups just read are kept in a small byte-bounded cache, because batches
take consecutive rows in arrival order.

Clients that ask for `application/vnd.apache.arrow.stream` (the factory's
exporter) get the rows the export reads as an Arrow IPC stream instead:
no number is turned into text on either end.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from environments.groups import GROUP_WIRE_FIELDS
from factory.schema import JSON_FIELDS
from factory.serve.contract import PayloadError, prefers_arrow  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

META_FIELDS = ("group_id", "env", "policy_version")
ARROW_COLUMNS = ["group_id", "run_id", "env", "item_key", "scores", "messages", "images", "tokens", "masks"]
"""The columns of an Arrow /batch: what the exporter reads (factory/export/source.py `groups_from_batch`)."""
READ_COLUMNS = [*GROUP_WIRE_FIELDS, *META_FIELDS, "run_id", "item_key"]
_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def _nulls(array: pa.Array) -> np.ndarray | None:
    """Which rows of `array` are null (None: none is), read from its validity bitmap. `Array.is_null()` would
    import pyarrow.compute for this one call: ~20 ms of CPU and ~1.4 MiB of RSS, kept (bench/RESULTS.md, issue 29)."""
    if array.null_count == 0:
        return None
    bits = np.frombuffer(array.buffers()[0], dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[array.offset : array.offset + len(array)] == 0


def _nested_views(column: pa.ChunkedArray | pa.Array, depth: int) -> list[list | None]:
    """Per row, the nested lists of a list<list<...>> column as lists of numpy views (None for null rows), chunk by
    chunk: views of the chunks' own buffers, no combined copy."""
    if isinstance(column, pa.ChunkedArray):
        return [row for chunk in column.chunks for row in _nested_views(chunk, depth)]
    array = column
    nulls = _nulls(array)
    offsets = [array.offsets.to_numpy()]
    level = array.values
    for _ in range(depth - 1):
        offsets.append(level.offsets.to_numpy())
        level = level.values
    leaf = level.to_numpy(zero_copy_only=False)
    outer = offsets[0]
    if nulls is None:
        nulls = itertools.repeat(False)
    return [None if null else _views(offsets, leaf, 1, outer[i], outer[i + 1]) if depth > 1 else leaf[outer[i] : outer[i + 1]]
            for i, null in zip(range(len(array)), nulls)]


def _views(offsets: list, leaf: Any, d: int, start: int, stop: int) -> list:
    """Rows start..stop of nesting level `d` as lists of numpy views of `leaf`.

    A module function, not a closure that calls itself: such a closure is a reference cycle (function -> cell ->
    function) that kept each batch's numpy views, and so its Arrow buffers, alive until the cyclic GC ran; several
    batches' buffers piled up while draining and ~10 MiB stayed after it (bench.serve.drain_rss)."""
    off = offsets[d]
    if d == len(offsets) - 1:
        return [leaf[off[i] : off[i + 1]] for i in range(start, stop)]
    return [_views(offsets, leaf, d + 1, off[i], off[i + 1]) for i in range(start, stop)]


def _rows(table: pa.Table, metadata: bool) -> list[dict]:
    """Each row of `table` (READ_COLUMNS) as the dict orjson writes as an Atropos ScoredData object: numbers as
    numpy views of the Arrow buffers, JSON-text fields spliced in as stored (orjson.Fragment)."""
    columns: dict[str, list] = {}
    for name in ("tokens", "masks", "advantages", "ref_logprobs", "inference_logprobs"):
        columns[name] = _nested_views(table.column(name), 2)
    columns["scores"] = _nested_views(table.column("scores"), 1)
    for name in ("distill_token_ids", "distill_logprobs"):
        columns[name] = _nested_views(table.column(name), 3)
    for name in (*JSON_FIELDS, "env_id", *META_FIELDS):
        columns[name] = table.column(name).to_pylist()
    for name in JSON_FIELDS:
        columns[name] = [None if value is None else orjson.Fragment(value) for value in columns[name]]
    fields = [*GROUP_WIRE_FIELDS, *(META_FIELDS if metadata else ())]
    return [{name: columns[name][i] for name in fields} for i in range(table.num_rows)]


def encode_groups(table: pa.Table, *, metadata: bool = False) -> list[bytes]:
    """Each row of `table` (READ_COLUMNS) as the JSON bytes of an Atropos ScoredData object."""
    return [orjson.dumps(row, option=_NUMPY) for row in _rows(table, metadata)]


def encode_batch(table: pa.Table, *, metadata: bool = False) -> bytes:
    """The /batch body of the rows of `table`: `batch_json(encode_groups(table))` in one orjson call, so the body
    is the only body-sized buffer made (one bytes per group, then their join, held twice the body at once)."""
    return orjson.dumps({"batch": _rows(table, metadata)}, option=_NUMPY)


def batch_rows(table: pa.Table, *, metadata: bool = False) -> list[dict]:
    """The rows of `table` as `gzip_batch` takes them (dicts of numpy views into the table's buffers)."""
    return _rows(table, metadata)


def json_batch(rows: list[dict], *, rows_per_chunk: int = 4) -> memoryview:
    """The /batch body of `rows` (what `encode_batch` makes), written a few rows at a time; empties `rows` as it goes.

    One orjson call for a whole batch holds the GIL throughout (30-40 ms for 32 groups of 8 x 1024 tokens on a loaded
    machine): a batch prefetched in a thread so kept the event loop from answering the trainer's next /batch and from
    sending the body it had. Between chunks the loop runs. The body grows in place (a bytearray, returned as a
    memoryview that responses send as is), and each row's views are dropped once written."""
    out = bytearray()
    _write_batch(rows, out.extend, rows_per_chunk)
    return memoryview(out)


def gzip_batch(rows: list[dict], compressor: Any, *, rows_per_chunk: int = 4) -> memoryview:
    """The /batch body of `rows` (what `encode_batch` makes), compressed by `compressor` (a zlib-style compressobj
    writing gzip) a few rows at a time; empties `rows` as it goes.

    The JSON body is never whole in memory (at gzip level 1 it is ~2.3x its gzip: a drain that made the whole JSON
    first held ~7 MB more per 32-group batch of 8 x 1024 tokens), and each row's views are dropped once it is
    compressed, so the batch's Arrow buffers are freed while its gzip grows (if the caller holds no other
    reference to them). The gzip grows in place (a bytearray, returned as a memoryview that responses send as is):
    joining its pieces at the end held it twice."""
    out = bytearray()
    _write_batch(rows, lambda piece: out.extend(compressor.compress(piece)), rows_per_chunk)
    out += compressor.flush()
    return memoryview(out)


def _write_batch(rows: list[dict], write: Callable[[Any], Any], rows_per_chunk: int) -> None:
    """The /batch body of `rows` handed to `write` in pieces, `rows_per_chunk` rows at a time, each row let go once
    written (`rows` is empty after)."""
    write(b'{"batch":[')
    for start in range(0, len(rows), rows_per_chunk):
        stop = min(start + rows_per_chunk, len(rows))
        chunk = orjson.dumps(rows[start:stop], option=_NUMPY)
        rows[start:stop] = [None] * (stop - start)
        if start:
            write(b",")
        write(memoryview(chunk)[1:-1])  # the rows without the list's brackets
        del chunk
    rows.clear()
    write(b"]}")


def batch_json(items: Sequence[bytes]) -> bytes:
    """The /batch body around `items`, made by one join: the body is the only copy (`prefix + b",".join(items) +
    suffix` held three body-sized copies at once, ~21 MB for a 7 MB body, which set the drain's peak RSS)."""
    parts = [b'{"batch":[']
    for item in items:
        parts += (item, b",")
    if items:
        parts.pop()
    parts.append(b"]}")
    return b"".join(parts)


def batch_arrow(table: pa.Table, *, compress: bool = False) -> bytes:
    """The ARROW_COLUMNS of `table` as Arrow IPC stream bytes; `compress` zstd-compresses the buffers (any Arrow
    reader inflates them itself)."""
    options = pa.ipc.IpcWriteOptions(compression="zstd" if compress else None)
    sink = pa.BufferOutputStream()
    projected = table.select(ARROW_COLUMNS)
    with pa.ipc.new_stream(sink, projected.schema, options=options) as writer:
        writer.write_table(projected)
    return sink.getvalue().to_pybytes()


class PayloadReader:
    """Reads rows of shards with a byte-bounded cache of recently read row groups."""

    def __init__(self, cache_bytes: int = 256 << 20, filesystem: pa.fs.FileSystem | None = None) -> None:
        self.cache_bytes = cache_bytes
        self.filesystem = filesystem
        """Where shard paths are opened (an object store's); None: they are local paths."""
        self._starts: OrderedDict[Path, list[int]] = OrderedDict()
        self._cache: OrderedDict[tuple[Path, int], pa.Table] = OrderedDict()
        self._cached = 0

    def _row_group_starts(self, path: Path) -> list[int]:
        starts = self._starts.get(path)
        if starts is None:
            meta = pq.ParquetFile(path, filesystem=self.filesystem).metadata
            starts, total = [], 0
            for i in range(meta.num_row_groups):
                starts.append(total)
                total += meta.row_group(i).num_rows
            self._starts[path] = starts
            if len(self._starts) > 4096:
                self._starts.popitem(last=False)
        return starts

    def _row_group(self, path: Path, index: int) -> pa.Table:
        table = self._cache.get((path, index))
        if table is not None:
            return table
        return pq.ParquetFile(path, filesystem=self.filesystem, page_checksum_verification=True).read_row_group(index, columns=READ_COLUMNS)

    def _keep_only(self, key: tuple[Path, int], table: pa.Table) -> None:
        """Cache just the row group of the last row a read took: batches take consecutive rows (oldest or newest
        first), so it is the only one the next batch can share; the others would only raise RSS while draining."""
        self._cache = OrderedDict([(key, table)]) if self.cache_bytes > 0 else OrderedDict()
        self._cached = table.nbytes if self._cache else 0

    def clear(self) -> bool:
        """Drop every cached row group (the queue is empty: nothing will be read next); whether any was held."""
        held = bool(self._cache)
        self._cache, self._cached = OrderedDict(), 0
        return held

    def read(self, keys: Sequence[tuple[Path, int]]) -> pa.Table:
        """The rows `keys` ((shard path, row)) as one table, in the order given."""
        pieces: list[pa.Table] = []
        order: list[int] = [0] * len(keys)
        wanted: dict[tuple[Path, int], list[tuple[int, int]]] = {}
        for position, (path, row) in enumerate(keys):
            try:
                starts = self._row_group_starts(path)
            except (OSError, pa.ArrowException) as error:
                raise PayloadError(f"shard {path} cannot be read: {error}", path) from error
            index = bisect.bisect_right(starts, row) - 1
            wanted.setdefault((path, index), []).append((position, row - starts[index]))
        offset = 0
        last_group = (path, index)  # the row group of the last key: the one the next batch can share
        last: pa.Table | None = None
        for (path, index), rows in wanted.items():
            try:
                table = self._row_group(path, index)
            except (OSError, pa.ArrowException) as error:
                raise PayloadError(f"shard {path} row group {index} cannot be read: {error}", path) from error
            local = [row for _, row in rows]
            if local == list(range(local[0], local[0] + len(local))):  # consecutive rows: a view, not a copy
                pieces.append(table.slice(local[0], len(local)))
            else:
                pieces.append(table.take(pa.array(local, type=pa.int64())))
            for k, (position, _) in enumerate(rows):
                order[position] = offset + k
            offset += len(rows)
            if (path, index) == last_group:
                last = table
        if last is not None:
            self._keep_only(last_group, last)
        combined = pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]
        if all(position == k for k, position in enumerate(order)):  # rows in the order asked (FIFO): no second copy
            return combined
        return combined.take(pa.array(order, type=pa.int64()))
