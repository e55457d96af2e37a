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
import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


def _nested_views(column: pa.ChunkedArray | pa.Array, depth: int) -> list[list | None]:
    """Per row, the nested lists of a list<list<...>> column as lists of numpy views (None for null rows), chunk by
    chunk: views of the chunks' own buffers, no combined copy."""
    if isinstance(column, pa.ChunkedArray):
        return [row for chunk in column.chunks for row in _nested_views(chunk, depth)]
    array = column
    nulls = array.is_null().to_numpy(zero_copy_only=False)
    offsets = [array.offsets.to_numpy()]
    level = array.values
    for _ in range(depth - 1):
        offsets.append(level.offsets.to_numpy())
        level = level.values
    leaf = level.to_numpy(zero_copy_only=False)
    outer = offsets[0]
    return [None if nulls[i] else _views(offsets, leaf, 1, outer[i], outer[i + 1]) if depth > 1 else leaf[outer[i] : outer[i + 1]]
            for i in range(len(array))]


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
        key = (path, index)
        table = self._cache.get(key)
        if table is not None:
            self._cache.move_to_end(key)
            return table
        table = pq.ParquetFile(path, filesystem=self.filesystem, page_checksum_verification=True).read_row_group(index, columns=READ_COLUMNS)
        self._cache[key] = table
        self._cached += table.nbytes
        while self._cached > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached -= old.nbytes
        return table

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
                raise PayloadError(f"shard {path} cannot be read: {error}") from error
            index = bisect.bisect_right(starts, row) - 1
            wanted.setdefault((path, index), []).append((position, row - starts[index]))
        offset = 0
        for (path, index), rows in wanted.items():
            try:
                table = self._row_group(path, index)
            except (OSError, pa.ArrowException) as error:
                raise PayloadError(f"shard {path} row group {index} cannot be read: {error}") from error
            pieces.append(table.take(pa.array([local for _, local in rows], type=pa.int64())))
            for k, (position, _) in enumerate(rows):
                order[position] = offset + k
            offset += len(rows)
        combined = pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]
        if all(position == k for k, position in enumerate(order)):  # rows in the order asked (FIFO): no second copy
            return combined
        return combined.take(pa.array(order, type=pa.int64()))
