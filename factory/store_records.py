"""A run's current commit records, with the members of compacted files kept as columns (one block per merged file).

After a compaction a run's history is a few hundred merged files holding up to millions of member shards. The
manifest keeps each run of consecutive members of one merged file as one row whose members are Arrow columns
(`Block`), and `Records` keeps such blocks as they are loaded: a start-up that reads the manifest makes a Python
object per merged file and per shard not yet compacted, not per member. Everything that asks for a member's
record by name, or for every record, still gets `CommitRecord`s (made when asked). A change to one member of a
block (a shard re-committed over a compacted one, a compaction record naming one: both rare) first turns every
block back into records (`Records.explode`), so that blocks never hold anything but current, unchanged members.

Before a compaction the history is a million shards each in its own file. The manifest keeps those as a row each;
`Records` keeps each long run of consecutive such rows as one `Loose` (the same columns, each member its own file,
its index summary by a code into the manifest's dictionary of summaries), with the same rules: a record made when
asked for, and a change to one member turning every block back into records first. So a reader that wants the
first files of a run's history (the export, the viewer's first page) makes no object per shard of it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from factory.store import CommitRecord

MEMBER_FIELDS = ["shard", "run_id", "producer", "chunk", "rows", "bytes", "sha256", "committed_at"]
"""Columns of a block's members (the fields of a commit line)."""
_SHARD_NAME = re.compile(r"^(?P<producer>.+)-(?P<chunk>\d{8,})\.parquet$")


def int64_values(column: Any, null: int = 0) -> np.ndarray:
    """An integer Arrow column as a numpy int64 array (nulls as `null`), read from its buffers: pyarrow's to_numpy
    (and pa.scalar, pa.array) import pandas, ~0.4 s that a start-up or a manifest save otherwise never needs."""
    return _int_values(column, null, pa.int64(), np.int64)


def int32_values(column: Any, null: int = 0) -> np.ndarray:
    """As `int64_values`, as a numpy int32 array, for 32-bit (or narrower) columns: an int32 column's buffer as it
    is, with no 64-bit copy (run-api queues millions of group sizes and dictionary codes at a start-up)."""
    return _int_values(column, null, pa.int32(), np.int32)


def _int_values(column: Any, null: int, type_: pa.DataType, dtype: Any) -> np.ndarray:
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if array.type != type_:
        array = array.cast(type_)
    validity, data = array.buffers()[:2]
    start, count = array.offset, len(array)
    if not count:
        return np.zeros(0, dtype)
    values = np.frombuffer(data, dtype=dtype, count=start + count)[start:]
    if array.null_count:
        bits = np.unpackbits(np.frombuffer(validity, dtype=np.uint8), bitorder="little")
        values = np.where(bits[start:start + count].astype(bool), values, null).astype(dtype, copy=False)
    return values


def column(values: list[Any], type_: pa.DataType) -> pa.Array:
    """An int64 or string Arrow array of Python values (no nulls), from buffers: `pa.array` imports pandas (~0.5 s),
    which a reader saving a manifest has no other use for."""
    if type_ == pa.int64():
        return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(np.array(values, dtype=np.int64))])
    if type_ == pa.int32():
        return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(np.array(values, dtype=np.int32))])
    if type_ != pa.string():
        raise TypeError(f"no column builder for {type_}")
    data = [value.encode() for value in values]
    offsets = np.zeros(len(data) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, data), dtype=np.int64, count=len(data)), out=offsets[1:])
    if offsets[-1] >= 1 << 31:
        raise ValueError("a string column of 2 GiB or more")
    return pa.Array.from_buffers(type_, len(data), [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(data))])


def column_of_lines(text: str) -> pa.Array:
    """The lines of `text` (separated by "\\n", no trailing one) as an Arrow string array, without a Python string
    per line; no lines for an empty `text`."""
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    if not len(data):
        return pa.Array.from_buffers(pa.string(), 0, [None, pa.py_buffer(np.zeros(1, np.int32)), pa.py_buffer(b"")])
    breaks = np.flatnonzero(data == 10)
    if len(data) - len(breaks) >= 1 << 31:
        raise ValueError("a string column of 2 GiB or more")
    offsets = np.empty(len(breaks) + 2, dtype=np.int32)
    offsets[0] = 0
    offsets[1:-1] = breaks - np.arange(len(breaks))  # each line's end once the breaks before it are dropped
    offsets[-1] = len(data) - len(breaks)
    return pa.Array.from_buffers(pa.string(), len(breaks) + 1,
                                 [None, pa.py_buffer(offsets), pa.py_buffer(np.delete(data, breaks))])


def table(columns: dict[str, list[Any]], schema: pa.Schema) -> pa.Table:
    """`pa.Table.from_pydict(columns, schema=schema)` for int64 and string columns, without importing pandas."""
    return pa.Table.from_arrays([column(columns[field.name], field.type) for field in schema], schema=schema)


def chunk_ranges(names: pa.ChunkedArray) -> dict[str, tuple[int, int]] | None:
    """Per producer, the lowest and highest chunk of shard names `<producer>-<chunk>.parquet`; None if a name is
    not of that form. A name whose (producer, chunk) is outside these is none of `names` (see `Records._may_hold`)."""
    import pyarrow.compute as pc

    parts = pc.extract_regex(names, _SHARD_NAME.pattern)
    if parts.null_count:
        return None
    parts = parts.combine_chunks()
    if not len(parts):
        return {}
    return _ranges_of(parts.field(0), int64_values(pc.cast(parts.field(1), pa.int64())))


def _ranges_of(producer_names: pa.Array, chunks: np.ndarray) -> dict[str, tuple[int, int]]:
    producers = producer_names.dictionary_encode()
    codes = int64_values(producers.indices)
    lows = np.full(len(producers.dictionary), np.iinfo(np.int64).max, dtype=np.int64)
    highs = np.full(len(producers.dictionary), -1, dtype=np.int64)
    np.minimum.at(lows, codes, chunks)
    np.maximum.at(highs, codes, chunks)
    return {p: (int(lo), int(hi)) for p, lo, hi in zip(producers.dictionary.to_pylist(), lows, highs)}


def regular_names(names: pa.ChunkedArray, producers: pa.ChunkedArray, chunks: pa.ChunkedArray) -> bool:
    """Whether every shard name is `<producer>-<chunk:08d>.parquet` of its own producer and chunk (as commits name
    shards), one compare per name."""
    import pyarrow.compute as pc

    count = len(names)
    if not count:
        return True
    # (constants as arrays: a Python string passed to a compute function becomes a pa.scalar, which imports pandas)
    expected = pc.binary_join_element_wise(
        producers.combine_chunks(), _repeated("-", count),
        pc.utf8_lpad(pc.cast(chunks.combine_chunks(), pa.string()), width=8, padding="0"),
        _repeated(".parquet", count), _repeated("", count))
    return bool(pc.all(pc.equal(names.combine_chunks(), expected)).as_py())


def _repeated(text: str, count: int) -> pa.Array:
    """A string array of `text` `count` times, from buffers."""
    data = text.encode()
    offsets = np.arange(count + 1, dtype=np.int32) * len(data)
    return pa.Array.from_buffers(pa.string(), count, [None, pa.py_buffer(offsets), pa.py_buffer(data * count)])


def _same_order(names: pa.Array, members: pa.Array) -> np.ndarray | None:
    """Where `names` are, in order, a stretch of `members` (shards indexed as they were committed, compacted in
    that order): their positions there, found by one compare of the stretch instead of a hash lookup per name
    (0.3 s at a million); else None."""
    import pyarrow.compute as pc

    if not len(names) or len(names) > len(members):
        return None
    start = pc.index(members, names[0]).as_py()
    if start < 0 or start + len(names) > len(members):
        return None
    if not pc.all(pc.equal(names, members.slice(start, len(names)))).as_py():
        return None
    return np.arange(start, start + len(names), dtype=np.int64)


class Block:
    """Consecutive members of one compacted file, rows `first ..` of it one member after the other, as columns."""

    __slots__ = ("file", "first", "members", "rows", "offsets", "total", "key")

    def __init__(self, file: str, first: int, members: pa.Table) -> None:
        self.file, self.first, self.members = file, int(first), members
        self.rows = int64_values(members.column("rows"))
        ends = np.cumsum(self.rows)
        self.offsets = self.first + ends - self.rows
        """Row of the file where each member's rows start."""
        self.total = int(ends[-1]) if len(ends) else 0
        self.key = f"\x00{file}\x00{self.first}"
        """Its key among `Records`' items and in a log's change list (no shard name starts with NUL)."""

    def __len__(self) -> int:
        return self.members.num_rows

    def names(self) -> list[str]:
        return self.members.column("shard").to_pylist()

    def records(self) -> list[CommitRecord]:
        """The members' records, in order (each made here: a frozen dataclass without its per-field setattr)."""
        from factory.store import CommitRecord

        columns = [self.members.column(name).to_pylist() for name in MEMBER_FIELDS]
        new, file, result = object.__new__, self.file, []
        for (shard, run_id, producer, chunk, rows, size, sha256, at), offset in zip(zip(*columns), self.offsets.tolist()):
            record = new(CommitRecord)
            record.__dict__.update(shard=shard, run_id=run_id, producer=producer, chunk=chunk, rows=rows, bytes=size,
                                   sha256=sha256, committed_at=at, skipped=False, file=file, row_offset=offset)
            result.append(record)
        return result

    def record(self, index: int) -> CommitRecord:
        from factory.store import CommitRecord

        values = {name: self.members.column(name)[index].as_py() for name in MEMBER_FIELDS}
        record = object.__new__(CommitRecord)
        record.__dict__.update(values, skipped=False, file=self.file, row_offset=int(self.offsets[index]))
        return record


LOOSE_MIN = 64
"""Consecutive records not compacted that a manifest's reader keeps as one `Loose` (fewer stay records)."""
_LOOSE_KEYS = iter(range(1, 1 << 62))


class Loose:
    """Consecutive records of shards in their own files (not compacted), as columns: members are their own file
    (`file` empty, `row_offset` 0), each with its index summary (`summaries[codes[i]]` where that adds up to its
    rows, else None; see store.load_manifest)."""

    __slots__ = ("members", "codes", "summaries", "totals", "key", "regular", "_lists", "_names", "_rows")

    def __init__(self, members: pa.Table, codes: np.ndarray | None, summaries: list[Any], totals: list[Any],
                 key: str | None = None, regular: bool = False) -> None:
        self.members, self.codes, self.summaries, self.totals = members, codes, summaries, totals
        self.regular = regular
        """Every member's name is known to be `<producer>-<chunk:08d>.parquet` of its own (`regular_names`; the
        manifest says so of its records); False: not known."""
        self.key = key if key is not None else f"\x00\x00{next(_LOOSE_KEYS)}"
        """Its key among `Records`' items and in a log's change list (no shard name or `Block.key` starts so)."""
        self._lists: list[list[Any]] | None = None
        self._names: list[str] | None = None
        self._rows: np.ndarray | None = None

    def __len__(self) -> int:
        return self.members.num_rows

    def slice(self, start: int, stop: int | None = None) -> Loose:
        """Members `start .. stop` as a Loose under the same key (the viewer indexes a pending one newest first)."""
        stop = len(self) if stop is None else stop
        codes = None if self.codes is None else self.codes[start:stop]
        return Loose(self.members.slice(start, stop - start), codes, self.summaries, self.totals, self.key,
                     self.regular)

    @property
    def rows(self) -> np.ndarray:
        """Rows of each member."""
        if self._rows is None:
            self._rows = int64_values(self.members.column("rows"))
        return self._rows

    @property
    def total(self) -> int:
        return int(self.rows.sum())

    def names(self) -> list[str]:
        """The members' shard names (made once; not the other fields, which a lookup by name does not need)."""
        if self._names is None:
            self._names = self.members.column("shard").to_pylist() if self._lists is None else self._lists[0]
        return self._names

    def lists(self) -> list[list[Any]]:
        """The members' `MEMBER_FIELDS` as Python lists (made once)."""
        if self._lists is None:
            self._lists = [self.names() if name == "shard" else self.members.column(name).to_pylist()
                           for name in MEMBER_FIELDS]
        return self._lists

    def _summary(self, index: int, rows: int) -> dict[str, Any] | None:
        if self.codes is None:
            return None
        code = int(self.codes[index])
        return self.summaries[code] if code and self.totals[code] == rows else None

    def chunk_ranges(self) -> dict[str, tuple[int, int]] | None:
        """`chunk_ranges` of the members' names: from their producer and chunk columns where every name is
        `<producer>-<chunk:08d>.parquet` of its own (as commits name shards; one compare per name, not a regex)."""
        if not len(self):
            return {}
        names, producers, chunks = (self.members.column(name) for name in ("shard", "producer", "chunk"))
        if not (self.regular or regular_names(names, producers, chunks)):
            return chunk_ranges(names)
        return _ranges_of(producers.combine_chunks(), int64_values(chunks))

    def files(self) -> Iterator[tuple[str, int, str]]:
        """(name, bytes, sha256) of each member's file, in order, without making its record."""
        shards, sizes, hashes = (self.members.column(name) for name in ("shard", "bytes", "sha256"))
        step = 4096  # a few thousand at a time: the first file is handed out before the rest are made Python values
        for start in range(0, len(self), step):
            yield from zip(shards.slice(start, step).to_pylist(), sizes.slice(start, step).to_pylist(),
                           hashes.slice(start, step).to_pylist())

    def records(self) -> list[CommitRecord]:
        """The members' records, in order (each made here, as `Block.records`)."""
        from factory.store import CommitRecord

        codes = self.codes.tolist() if self.codes is not None else itertools.repeat(0)
        summaries, totals, new, result = self.summaries, self.totals, object.__new__, []
        for (shard, run_id, producer, chunk, rows, size, sha256, at), code in zip(zip(*self.lists()), codes):
            record = new(CommitRecord)
            fields = record.__dict__  # (assigned one by one: ~2x faster than update() with keywords)
            (fields["shard"], fields["run_id"], fields["producer"], fields["chunk"], fields["rows"], fields["bytes"],
             fields["sha256"], fields["committed_at"], fields["skipped"], fields["file"], fields["row_offset"],
             fields["index"]) = (shard, run_id, producer, chunk, rows, size, sha256, at, False, "", 0,
                                 summaries[code] if code and totals[code] == rows else None)
            result.append(record)
        return result

    def own_files(self) -> Iterator[tuple[int, str, int, int, dict[str, Any] | None]]:
        """(position, shard, rows, bytes, index summary or None) of each member, without making its record (nor
        Python values of the fields it does not give: run-api's start-up at a million shards)."""
        rows_, sizes = self.members.column("rows").to_pylist(), self.members.column("bytes").to_pylist()
        codes = self.codes.tolist() if self.codes is not None else itertools.repeat(0)
        summaries, totals = self.summaries, self.totals
        for at, (shard, rows, size, code) in enumerate(zip(self.names(), rows_, sizes, codes)):
            yield at, shard, rows, size, summaries[code] if code and totals[code] == rows else None

    def record(self, index: int) -> CommitRecord:
        from factory.store import CommitRecord

        shards, run_ids, producers, chunks, rows_, sizes, hashes, times = self.lists()
        rows = rows_[index]
        record = object.__new__(CommitRecord)
        record.__dict__.update(shard=shards[index], run_id=run_ids[index], producer=producers[index],
                               chunk=chunks[index], rows=rows, bytes=sizes[index], sha256=hashes[index],
                               committed_at=times[index], skipped=False, file="", row_offset=0,
                               index=self._summary(index, rows))
        return record


GROUPED = (Block, Loose)
"""The item types of `Records` that hold many members (anything else is a `CommitRecord`)."""


class Records:
    """Current records by shard name, in log order (a re-committed shard moves to the end; a compacted one keeps
    its place), with blocks of compacted members kept as `Block`s and runs of loaded records not compacted as
    `Loose`: the mapping a dict of records was, plus `items_in_order` and `block` for callers that can take a block
    whole."""

    def __init__(self) -> None:
        self._items: dict[str, Any] = {}
        self._blocks = 0
        self._members = 0
        self._index: dict[str, tuple[Block, int]] | None = None
        self._ranges: dict[str, tuple[int, int]] | None = None
        self._block_ranges: dict[str, tuple[int, int]] | None | bool = False
        """`chunk_ranges` of the `Block`s' names where known (saved with the manifest); False: not known."""
        self._irregular = False
        self.on_explode: Callable[[dict[str, list[str]]], None] | None = None
        """Called with {block key: member names} after `explode`, so a log's change list can follow."""

    # ---- blocks ----
    def add_block(self, block: Block | Loose) -> None:
        self._items[block.key] = block
        self._blocks += 1
        self._members += len(block)
        self._index = self._ranges = None
        self._block_ranges = False

    @property
    def has_blocks(self) -> bool:
        return self._blocks > 0

    def items_in_order(self) -> Iterator[Any]:
        """Records and blocks (`Block`, `Loose`), in log order."""
        return iter(self._items.values())

    def block(self, key: str) -> Block | None:
        item = self._items.get(key)
        return item if type(item) is Block else None

    def _may_hold(self, name: str) -> bool:
        """False only where no block can hold `name`: its (producer, chunk) is outside every producer's range of
        chunks in the blocks (new commits, the usual case, are: no index of every member is built for them)."""
        if self._ranges is None:
            self._ranges = self._chunk_ranges()
        if self._irregular:
            return True
        match = _SHARD_NAME.match(name)
        if match is None:
            return False  # every block member's name matches (else _irregular)
        span = self._ranges.get(match.group(1))
        return span is not None and span[0] <= int(match.group(2)) <= span[1]

    def _chunk_ranges(self) -> dict[str, tuple[int, int]]:
        parts: list[dict[str, tuple[int, int]] | None] = []
        if self._block_ranges is False:
            blocks = [item for item in self._items.values() if type(item) is Block]
            if blocks:  # (none: no pyarrow.compute call, whose first one costs an import)
                parts.append(chunk_ranges(pa.chunked_array(
                    [chunk for b in blocks for chunk in b.members.column("shard").chunks], pa.string())))
        else:
            parts.append(self._block_ranges)  # type: ignore[arg-type]
        parts += [item.chunk_ranges() for item in self._items.values() if type(item) is Loose]
        self._irregular = any(part is None for part in parts)
        ranges: dict[str, tuple[int, int]] = {}
        for part in parts:
            for producer, (low, high) in (part or {}).items():
                known = ranges.get(producer)
                ranges[producer] = (low, high) if known is None else (min(known[0], low), max(known[1], high))
        return ranges

    def set_chunk_ranges(self, ranges: dict[str, tuple[int, int]] | None) -> None:
        """What `chunk_ranges` says of the `Block`s' names, known already (saved with the manifest); those of the
        `Loose` runs are worked out from their columns when first needed."""
        self._block_ranges = ranges
        if any(type(item) is Loose for item in self._items.values()):
            self._ranges = None
        else:
            self._ranges, self._irregular = (ranges or {}), ranges is None

    def _in_blocks(self, name: str) -> tuple[Block | Loose, int] | None:
        if not self._blocks:
            return None
        if self._index is not None:  # (built: one look, not the name's chunk range first)
            return self._index.get(name)
        if not self._may_hold(name):
            return None
        if self._index is None:
            index: dict[str, tuple[Block | Loose, int]] = {}
            for item in self._items.values():
                if type(item) in GROUPED:
                    index.update(zip(item.names(), ((item, i) for i in range(len(item)))))
            self._index = index
        return self._index.get(name)

    def where(self, name: str) -> tuple[str, int] | None:
        """(file holding the shard's rows, first row in it), without making its record; None if not committed."""
        item = self._items.get(name)
        if item is not None:
            return item.physical, item.row_offset
        hit = self._in_blocks(name)
        if hit is None:
            return None
        block, at = hit
        return (name, 0) if type(block) is Loose else (block.file, int(block.offsets[at]))

    def locate(self, names: pa.Array) -> tuple[np.ndarray, list[str], np.ndarray]:
        """`where` for many shard names at once, as columns: a code per name into the returned list of files (-1
        where the shard is in its own file or not committed) and the first row of its rows in that file. Hash
        lookups of the whole column, not a dict of every member (what `where` builds on its first call)."""
        import pyarrow.compute as pc

        codes, firsts = np.full(len(names), -1, np.int64), np.zeros(len(names), np.int64)
        files: dict[str, int] = {}
        blocks = [item for item in self._items.values() if type(item) is Block]
        if blocks and len(names):
            members = pa.chunked_array([chunk for b in blocks for chunk in b.members.column("shard").chunks],
                                       pa.string()).combine_chunks()
            at = _same_order(names, members)
            if at is None:
                at = int64_values(pc.index_in(names, value_set=members), null=-1)
            hit = np.flatnonzero(at >= 0)
            block_files = np.array([files.setdefault(b.file, len(files)) for b in blocks], dtype=np.int64)
            codes[hit] = np.repeat(block_files, [len(b) for b in blocks])[at[hit]]
            firsts[hit] = np.concatenate([b.offsets for b in blocks])[at[hit]]
        moved = {name: item for name, item in self._items.items()
                 if type(item) not in GROUPED and item.physical != name}  # records of shards merged one by one
        if moved and len(names):
            records = list(moved.values())
            at = int64_values(pc.index_in(names, value_set=column(list(moved), pa.string())), null=-1)
            for index in np.flatnonzero(at >= 0).tolist():
                record = records[at[index]]
                codes[index], firsts[index] = files.setdefault(record.physical, len(files)), record.row_offset
        return codes, list(files), firsts

    def own(self, name: str) -> CommitRecord | None:
        """A shard's record where it is a record or a member of a `Loose` (made then); None for a member of a
        compacted block (not in its own file) or a shard not committed."""
        item = self._items.get(name)
        if item is not None:
            return item
        hit = self._in_blocks(name)
        return hit[0].record(hit[1]) if hit is not None and type(hit[0]) is Loose else None

    def explode(self) -> None:
        """Turn every block back into records, in place (see the module docstring)."""
        if not self._blocks:
            return
        items: dict[str, Any] = {}
        expanded: dict[str, list[str]] = {}
        for key, item in self._items.items():
            if type(item) in GROUPED:
                records = item.records()
                expanded[key] = [r.shard for r in records]
                items.update((r.shard, r) for r in records)
            else:
                items[key] = item
        self._items, self._blocks, self._members, self._index, self._ranges = items, 0, 0, None, None
        self._block_ranges = False
        if self.on_explode is not None:
            self.on_explode(expanded)

    # ---- the mapping ----
    def get(self, name: str, default: Any = None) -> Any:
        item = self._items.get(name)
        if item is not None:
            return item
        hit = self._in_blocks(name)
        return hit[0].record(hit[1]) if hit else default

    def __getitem__(self, name: str) -> CommitRecord:
        record = self.get(name)
        if record is None:
            raise KeyError(name)
        return record

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._items or self._in_blocks(name) is not None)

    def __len__(self) -> int:
        return len(self._items) - self._blocks + self._members

    def __iter__(self) -> Iterator[str]:
        for key, item in self._items.items():
            if type(item) in GROUPED:
                yield from item.names()
            else:
                yield key

    def keys(self) -> Iterator[str]:
        return iter(self)

    def values(self) -> Iterator[CommitRecord]:
        for item in self._items.values():
            if type(item) in GROUPED:
                yield from item.records()
            else:
                yield item

    def items(self) -> Iterator[tuple[str, CommitRecord]]:
        for record in self.values():
            yield record.shard, record

    def as_dict(self) -> dict[str, CommitRecord]:
        return {record.shard: record for record in self.values()}

    def pop(self, name: str, default: Any = None) -> Any:
        if name in self._items:
            return self._items.pop(name)
        if self._in_blocks(name) is not None:
            self.explode()
            return self._items.pop(name)
        return default

    def __setitem__(self, name: str, record: CommitRecord) -> None:
        if name not in self._items and self._in_blocks(name) is not None:
            self.explode()
        self._items[name] = record
