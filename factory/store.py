"""The shard store: crash-safe Parquet shards plus a commit log, the only hand-off between stages.

Layout under `root`::

    <run_id>/shards/<producer>-<chunk:08d>.parquet   committed shards (zstd, page checksums)
    <run_id>/shards/.<name>.<nonce>.tmp               a shard being written (hidden from globbing readers)
    <run_id>/commits.jsonl                            one checksummed line per commit: shard, rows, bytes, sha256,
                                                      index columns as runs (factory/index_runs.py)

A commit writes a hidden temporary file and fsyncs it and its directory; then,
under the run's lock, it appends the commit record in one checked write and
fsyncs the log (the commit point; see commit_log.py), and only then renames
the shard to its visible name. So a glob reader (`<run>/shards/*.parquet`)
sees exactly the committed shards; a crash or a full disk before the commit
point leaves only a hidden temporary file, and one after it leaves a logged
shard that the next commit (or read) of the run renames into place.
Readers trust the commit log: a shard that is not logged, has the wrong size,
or fails its page checksums is reported with its path and left out.
`verify` finds what is inconsistent and `store_repair.repair` fixes what can be.
Shard names are a pure function of (run, producer, chunk), so a retried or
resumed writer skips (or, asked to, replaces) a chunk instead of duplicating it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import itertools
import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from dataclasses import replace as replace_record
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from environments.groups import ScoredGroup, describe_validation_error
from factory.commit_log import CommitLineError, LogUncertain, append_line, decode_line, encode_line, fsync_dir, salvage_line
from factory.index_runs import intern, summarize_rows, summarize_table, total_rows, valid
from factory.schema import GROUP_SCHEMA, groups_to_record_batch, record_batch_to_groups
from factory.store_records import (GROUPED, LOOSE_MIN, MEMBER_FIELDS, Block, Loose, Records, chunk_ranges, column,
                                   int64_values, regular_names)
from factory.store_records import table as make_table

logger = logging.getLogger(__name__)

_NAME_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=-]{0,127}$")
_SCALAR_COLUMNS = [f.name for f in GROUP_SCHEMA if not pa.types.is_list(f.type)]
_SMALL_COLUMNS = [f.name for f in GROUP_SCHEMA if pa.types.is_integer(f.type) or pa.types.is_timestamp(f.type)
                  or f.name in ("group_id", "run_id", "env", "item_key")]
_COMPRESSION: dict[str, str] = {}
for _field in GROUP_SCHEMA:  # Parquet names each leaf column by its path (tokens.list.element.list.element)
    _path, _type = [_field.name], _field.type
    while pa.types.is_list(_type):
        _path += ["list", "element"]
        _type = _type.value_type
    _COMPRESSION[".".join(_path)] = "none" if _field.name in _SMALL_COLUMNS else "zstd"
PARQUET_OPTIONS: dict[str, Any] = {
    # zstd where the bytes are (number lists, JSON text); not on the small scalar columns (ids, names, versions,
    # dictionary-encoded already), where it saved nothing and cost a compressor per column chunk: ~0.3 ms of a
    # 1-4 group shard's ~1.5-2.8 ms encode (the batching API commits one such shard per few posts).
    "compression": _COMPRESSION,
    # No dictionaries: on token and logprob lists they cost ~half the encode time and make random token ids
    # bigger, not smaller; on the scalar columns of a shard of a few groups they saved nothing measurable (36 kB
    # shards of 10 groups: 35.5 kB with, 35.5 kB without), and a column chunk with a dictionary page cannot be
    # merged with others page by page (factory/parquet_pages.py: compaction would have to decode it).
    "use_dictionary": False,
    # Min/max statistics only where they pay: on the scalar columns.
    "write_statistics": _SCALAR_COLUMNS,
}
READ_BATCH_GROUPS = 64


class StoreError(RuntimeError):
    """A store operation that cannot go on; the message says which path and why.

    `errno` is the OS error behind it (e.g. errno.ENOSPC for a full disk), if any.
    """

    def __init__(self, message: str, errno_: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno_

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a compaction worker process, re-raised in its parent
        return type(self), (str(self), self.errno)


class RecordMaybeLogged(StoreError):
    """Appending a record to a commit log failed in a way that may have left it in the log: whatever the record
    names must be kept, so that the next read can finish what the record says."""


def _write_failure(what: str, path: Path, error: OSError) -> StoreError:
    hint = " (the disk is full: free space, then rerun)" if error.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return StoreError(f"{what} {path} failed: {error.strerror or error}{hint}", error.errno)


@dataclass(frozen=True)
class CommitRecord:
    """One line of a run's commit log."""

    shard: str
    run_id: str
    producer: str
    chunk: int
    rows: int
    bytes: int
    sha256: str
    committed_at: str
    skipped: bool = field(default=False, compare=False)
    """True when `commit` found the chunk already committed and wrote nothing."""
    file: str = ""
    """The file holding the shard's rows once a compaction merged it (empty: the shard's own file)."""
    row_offset: int = 0
    """Where the shard's rows start in `file`."""
    index: dict[str, Any] | None = field(default=None, compare=False)
    """The shard's index columns (env, env_id, policy_version, group_size) as runs (factory/index_runs.py), as
    its commit wrote them; None in records written before (and once compacted: the merged file's summary holds)."""

    @property
    def physical(self) -> str:
        """Name (under `shards/`) of the file that holds this shard's rows."""
        return self.file or self.shard

    def _logged(self) -> dict[str, Any]:
        record = asdict(self)
        for name in ("skipped", "file", "row_offset"):  # not part of a commit line: compaction records say where rows moved
            record.pop(name)
        if record["index"] is None:  # lines as before where there is no summary
            record.pop("index")
        return record

    def to_json(self) -> str:
        """The record as JSON without a check (the format before checked lines; still read)."""
        return json.dumps(self._logged(), sort_keys=True)

    def to_line(self) -> bytes:
        """The record's commit-log line (checksummed, with its newline)."""
        return encode_line(self._logged())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CommitRecord:
        """A record from a parsed line; keys this version does not know are ignored."""
        known = {name: data[name] for name in cls.__dataclass_fields__
                 if name in data and name not in ("skipped", "file", "row_offset", "index")}
        summary = data.get("index")
        if summary is not None:  # kept only where it is well formed and adds up to the record's rows
            summary = intern(summary) if valid(summary, known.get("rows")) else None
        try:
            return cls(**known, index=summary)
        except TypeError as error:
            raise CommitLineError(f"not a commit record: {error}") from None


def parse_commit_line(line: bytes) -> CommitRecord:
    """The record of one commit-log line; raises CommitLineError (a ValueError) if it is torn or damaged."""
    return CommitRecord.from_dict(decode_line(line))


_GENERATIONS = itertools.count(1)


class _LogTail:
    """What this process has parsed of one run's commit log: up to `offset` bytes, `lines` lines."""

    TAIL = 64

    def __init__(self, inode: int) -> None:
        self.inode, self.offset, self.lines = inode, 0, 0
        self.generation = next(_GENERATIONS)
        self.records = Records()
        """Current records by shard (a mapping; members of compacted files loaded from a manifest stay blocks)."""
        self.records.on_explode = self._exploded
        self.files: dict[str, tuple[int, str, int]] = {}
        """Compacted files: name -> (bytes, sha256, rows). A shard not compacted is its own file (its record says)."""
        self.changed: list[str] = []
        """Shards in the order their record was added or changed (committed, replaced, compacted): followers
        read what is new from their last position in it instead of walking the whole history. A block of
        compacted members loaded from a manifest is one entry (its `Block.key`), as is a `Loose` run of records."""
        self.rows = 0
        self.bad: list[tuple[int, str, bool]] = []
        """(line number, why, whether a whole record was salvaged from it) of each damaged line."""
        self.torn = 0
        """Bytes after the last newline (a torn last line), as of the last read."""
        self.tail = b""
        """The last bytes parsed: a log rewritten or cut back under us no longer matches them."""
        self.checkpoint_lines = 0
        """Lines covered by the run's manifest when it was last read or written."""
        self.checkpoint_changes = 0
        """len(changed) when the manifest was last read or written (a compaction line changes thousands)."""
        self.index_runs: dict[str, dict[str, Any]] = {}
        """Compacted files' index columns as runs (factory/index_runs.py), where their compaction record has them."""

    def _exploded(self, expanded: dict[str, list[str]]) -> None:
        """The records' blocks became records: their change entries become their members' names, and cursors
        into the old list are void (a follower holding one gets every record again, and skips what it knows)."""
        self.changed = [name for entry in self.changed for name in expanded.get(entry, (entry,))]
        self.generation = next(_GENERATIONS)

    def put(self, record: CommitRecord) -> None:
        old = self.records.pop(record.shard, None)
        if old is not None:
            self.rows -= old.rows
        self.records[record.shard] = record
        self.rows += record.rows
        self.changed.append(record.shard)

    def compact(self, data: dict[str, Any]) -> None:
        """Apply a compaction record: its members' rows now live in one file, in the order listed."""
        name = data["compact"]
        self.files[name] = (int(data["bytes"]), str(data["sha256"]), int(data["rows"]))
        summary = data.get("index")
        if isinstance(summary, dict) and isinstance(summary.get("runs"), list) and summary.get("env") is not None:
            self.index_runs[name] = summary
        offset = 0
        records, new = self.records, object.__new__
        for shard, rows, sha256 in data["members"]:
            record = records.get(shard)
            if record is not None and record.sha256 == sha256 and record.rows == rows:
                # dataclasses.replace, without its per-field checks (a compaction record moves thousands of shards)
                moved = new(CommitRecord)
                moved.__dict__.update(record.__dict__, file=name, row_offset=offset, index=None)
                records[shard] = moved  # (may turn blocks back into records first, which renews self.changed)
                self.changed.append(shard)
            else:  # the compactor checks this under the run's lock; a mismatch means a hand-edited log
                logger.error("compaction record %s names shard %s that the log does not hold as such; left as it is", name, shard)
            offset += rows

    def physical(self, name: str) -> tuple[int, str] | None:
        """(bytes, sha256) the file `name` under `shards/` must have, if the log makes it live."""
        if name in self.files:
            return self.files[name][:2]
        record = self.records.get(name)
        if record is not None and not record.file:
            return record.bytes, record.sha256
        return None

    def live(self) -> list[tuple[str, int, str, list[tuple[int, int]] | None]]:
        """Live files in commit order: (name, bytes, sha256, row ranges to read, or None for all of them)."""
        return list(self.iter_live())

    def iter_live(self) -> Iterator[tuple[str, int, str, list[tuple[int, int]] | None]]:
        """`live`, one file at a time, as the records stand at the first one: the row ranges of each merged file
        (which need every member's place) are gathered first, from the blocks and moved records only; the files of
        shards not compacted, `Loose` runs of them included, are handed out as they come, so the first files wait
        for no pass over a history of loose shards."""
        items = list(self.records.items_in_order())  # (a commit meanwhile, by another thread, changes the dict)
        merged: dict[str, list[tuple[int, int]]] = {}
        """Merged file -> row ranges of its current members."""
        for item in items:
            kind = type(item)
            if kind is Block:
                merged.setdefault(item.file, []).append((item.first, item.first + item.total))
            elif kind is not Loose and item.file:
                merged.setdefault(item.file, []).append((item.row_offset, item.row_offset + item.rows))
        done: set[str] = set()
        for item in items:
            kind = type(item)
            if kind is Loose:
                yield from ((name, size, sha256, None) for name, size, sha256 in item.files())
                continue
            if kind is not Block and not item.file:  # a shard in its own file
                yield item.shard, item.bytes, item.sha256, None
                continue
            name = item.file
            if name in done:
                continue
            done.add(name)
            if name in self.files:
                ranges = sorted(merged[name])
                joined = [ranges[0]]
                for start, stop in ranges[1:]:  # adjacent ranges as one (members one by one, or blocks of them)
                    if start == joined[-1][1]:
                        joined[-1] = (joined[-1][0], stop)
                    else:
                        joined.append((start, stop))
                size, sha256, total = self.files[name]
                whole = len(joined) == 1 and joined[0] == (0, total)
                yield name, size, sha256, None if whole else joined
            else:  # (a compacted file no compaction record names: as the log's record of that name says)
                record = self.records[name]
                yield name, record.bytes, record.sha256, None


MANIFEST_NAME = "manifest.arrow"
MANIFEST_EVERY_LINES = 1000
"""A manifest is rewritten once the log has grown by this many lines and by a quarter since the last one:
its cost stays proportional to the log's growth."""
_MANIFEST_VERSION = 2
"""1: a row per record. 2: a row per record not compacted, and a row per run of consecutive members of one merged
file (`shard` empty, `file`, `row_offset` of the first member, `rows` in all), its members in the `members` list;
and, where the manifest has an `index` column (written since the commit records carry one), each record's index
summary as JSON (dictionary-encoded: a run's shards share a handful of summaries; "" for none). A manifest without
the column is read as before (no summaries: those shards' files are read), and a reader that does not know the
column ignores it. The metadata's `regular_records` (since `Loose`; absent before): whether every record row's shard
is `shard_name(producer, chunk)` of its own, so that a reader takes a `Loose` run's chunk ranges from its columns."""
_MANIFEST_SCHEMA = pa.schema([
    ("shard", pa.string()), ("run_id", pa.string()), ("producer", pa.string()), ("chunk", pa.int64()),
    ("rows", pa.int64()), ("bytes", pa.int64()), ("sha256", pa.string()), ("committed_at", pa.string()),
    ("file", pa.string()), ("row_offset", pa.int64()),
])
_MEMBER_SCHEMA = pa.schema([_MANIFEST_SCHEMA.field(name) for name in MEMBER_FIELDS])
_MANIFEST_SCHEMA_V2 = _MANIFEST_SCHEMA.append(pa.field("members", pa.list_(pa.struct(list(_MEMBER_SCHEMA))))).append(
    pa.field("index", pa.dictionary(pa.int32(), pa.string())))


def _manifest_table(log: _LogTail) -> tuple[pa.Table, dict[str, tuple[int, int]] | None, bool]:
    """The manifest's rows (see _MANIFEST_VERSION): records as they are, runs of members of a merged file (blocks
    loaded as such, or records that a compaction moved since) as one row each; the chunk ranges of the merged files'
    members; whether every record's shard name is `shard_name(producer, chunk)` of its own."""
    columns: dict[str, list[Any]] = {name: [] for name in _MANIFEST_SCHEMA.names}
    summaries: list[int] = []
    """Per row, its code in `texts` (the record's index summary as JSON; 0: none)."""
    texts: dict[str, int] = {"": 0}
    codes: dict[int, int] = {}
    offsets = [0]
    pieces: list[pa.Table] = []
    loose: dict[str, list[Any]] = {name: [] for name in MEMBER_FIELDS}
    run: list[CommitRecord] = []

    def code_of(summary: dict[str, Any] | None) -> int:
        if summary is None:
            return 0
        code = codes.get(id(summary))
        if code is None:
            code = codes[id(summary)] = texts.setdefault(json.dumps(summary, separators=(",", ":")), len(texts))
        return code

    def row(values: dict[str, Any], members: int, summary: dict[str, Any] | None = None) -> None:
        for name in _MANIFEST_SCHEMA.names:
            columns[name].append(values[name])
        offsets.append(offsets[-1] + members)
        summaries.append(code_of(summary))

    def loose_rows(item: Loose) -> None:
        """A row per member of a `Loose` (each a record in its own file), from its columns."""
        count = len(item)
        for name, values in zip(MEMBER_FIELDS, item.lists()):
            columns[name].extend(values)
        columns["file"].extend([""] * count)
        columns["row_offset"].extend([0] * count)
        offsets.extend([offsets[-1]] * count)
        if item.codes is None:
            summaries.extend([0] * count)
            return
        new_codes = np.array([code_of(summary) for summary in item.summaries], dtype=np.int64)
        totals = np.array([-1 if total is None else total for total in item.totals], dtype=np.int64)
        kept = (item.codes != 0) & (totals[item.codes] == item.rows)  # as `Loose.records` gives each its summary
        summaries.extend(np.where(kept, new_codes[item.codes], 0).tolist())

    def block_row(file: str, first: int, rows: int, members: int) -> None:
        row({"shard": "", "run_id": "", "producer": "", "chunk": 0, "rows": rows, "bytes": 0, "sha256": "",
             "committed_at": "", "file": file, "row_offset": first}, members)

    def flush_run() -> None:
        if run:
            for name in MEMBER_FIELDS:
                loose[name].extend(getattr(r, name) for r in run)
            block_row(run[0].file, run[0].row_offset, sum(r.rows for r in run), len(run))
            run.clear()

    def flush_loose() -> None:
        if loose["shard"]:
            pieces.append(make_table(loose, _MEMBER_SCHEMA))
            for values in loose.values():
                values.clear()

    for item in log.records.items_in_order():
        if type(item) is Block:
            flush_run()
            flush_loose()
            pieces.append(item.members)
            block_row(item.file, item.first, item.total, len(item))
        elif type(item) is Loose:
            flush_run()
            loose_rows(item)
        elif item.file:
            last = run[-1] if run else None
            if last is not None and (last.file != item.file or last.row_offset + last.rows != item.row_offset):
                flush_run()
            run.append(item)
        else:
            flush_run()
            row(item.__dict__, 0, item.index)
    flush_run()
    flush_loose()
    members = pa.concat_tables(pieces) if pieces else _MEMBER_SCHEMA.empty_table()
    values = pa.StructArray.from_arrays([members.column(name).combine_chunks() for name in MEMBER_FIELDS],
                                        fields=list(_MEMBER_SCHEMA))
    lists = pa.ListArray.from_arrays(column(offsets, pa.int32()), values)
    index = pa.DictionaryArray.from_arrays(column(summaries, pa.int32()), column(list(texts), pa.string()))
    table = pa.Table.from_arrays([*make_table(columns, _MANIFEST_SCHEMA).columns, lists, index], schema=_MANIFEST_SCHEMA_V2)
    own = pa.chunked_array([pa.Array.from_buffers(pa.bool_(), table.num_rows, [None, pa.py_buffer(np.packbits(
        ~_empty(table.column("shard")), bitorder="little"))])]) if table.num_rows else None
    regular = own is None or regular_names(*(table.column(name).filter(own) for name in ("shard", "producer", "chunk")))
    return table, chunk_ranges(members.column("shard")), regular


def save_manifest(path: Path, log: _LogTail) -> bool:
    """Checkpoint what has been parsed of a run's log (records as they stand after compactions) to `path`.

    The manifest is a cache: the log stays the record of every commit. It names the log offset it covers
    and the log bytes just before it, so a log cut back or rewritten since (repair) is noticed and the
    manifest ignored. Written under a temporary name and renamed; failures (a read-only store) are ignored.
    """
    log.checkpoint_lines, log.checkpoint_changes = log.lines, len(log.changed)
    table, chunks, regular = _manifest_table(log)
    meta = {"version": _MANIFEST_VERSION, "offset": log.offset, "lines": log.lines, "tail": log.tail.hex(),
            "files": log.files, "bad": log.bad, "index": log.index_runs,
            "chunks": {"regular": chunks is not None, "ranges": chunks or {}}, "regular_records": regular}
    table = table.replace_schema_metadata({"manifest": json.dumps(meta)})
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "wb") as handle:
            with pa.ipc.new_file(handle, table.schema) as writer:
                writer.write_table(table)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        return True
    except OSError as error:
        logger.debug("cannot write the manifest %s (%s); the commit log is read instead", path, error)
        return False
    finally:
        tmp.unlink(missing_ok=True)


_FEW_VALUES = ("run_id", "producer", "file")
"""Manifest columns with a handful of distinct values (a run, its producers, merged files): their records share one
string object per value (`_shared_strings`), not one each (~50 bytes and ~40 ns a record at a million)."""


def _shared_strings(column: pa.ChunkedArray) -> list[Any]:
    """`column.to_pylist()`, with one Python object per distinct value.

    Arrow's dictionary_encode through `pyarrow._compute` (the function `pc.dictionary_encode` calls) and the codes
    read from their buffer: `pyarrow.compute`'s Python module and `Array.to_numpy` (which imports pandas) stay out of
    a start-up, as everywhere in the store's read path."""
    import numpy as np

    if column.null_count or not len(column):
        return column.to_pylist()
    try:
        from pyarrow._compute import call_function
    except ImportError:  # pragma: no cover - pyarrow moved its private module
        return column.to_pylist()
    encoded = call_function("dictionary_encode", [column.combine_chunks()])
    values = np.empty(len(encoded.dictionary), dtype=object)
    values[:] = encoded.dictionary.to_pylist()
    return values[int64_values(encoded.indices)].tolist()


def _empty(strings: pa.ChunkedArray) -> np.ndarray:
    """Per value of a string column without nulls, whether it is empty (from its offsets: no Python string made)."""
    array = strings.combine_chunks()
    if not len(array):
        return np.zeros(0, dtype=bool)
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int32, count=array.offset + len(array) + 1)[array.offset:]
    return offsets[1:] == offsets[:-1]


def load_manifest(path: Path, log_path: Path, stat: os.stat_result) -> _LogTail | None:
    """The parsed state a manifest checkpoints, if it still matches the log at `log_path`; else None."""
    try:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_file(source).read_all()
        meta = json.loads(table.schema.metadata[b"manifest"])
        offset, tail = int(meta["offset"]), bytes.fromhex(meta["tail"])
        version = meta.get("version")
        if version not in (1, _MANIFEST_VERSION) or offset > stat.st_size or len(tail) > offset:
            return None
        with open(log_path, "rb") as log:
            log.seek(offset - len(tail))
            if log.read(len(tail)) != tail:
                return None
        members = None
        if version == 2:
            lists = table.column("members").combine_chunks()
            bounds = int64_values(lists.offsets).tolist()
            members = pa.Table.from_arrays(lists.values.flatten(), names=MEMBER_FIELDS)
        summaries: list[Any] | None = None
        if "index" in table.column_names:  # (see _MANIFEST_VERSION) each distinct summary parsed once
            index = table.column("index").combine_chunks()
            parsed = [json.loads(text) if text else None for text in index.dictionary.to_pylist()]
            summaries = [None if s is None else intern(s) for s in parsed]
            totals = [total_rows(s) for s in summaries]  # a row's summary is used where it adds up to its rows
            code_array = int64_values(index.indices)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as error:
        logger.warning("ignoring the manifest %s (%s); reading the whole commit log", path, error)
        return None
    loaded = _LogTail(stat.st_ino)
    loaded.offset, loaded.lines, loaded.tail = offset, int(meta["lines"]), tail
    loaded.checkpoint_lines = loaded.lines
    loaded.files = {name: tuple(value) for name, value in meta["files"].items()}
    loaded.bad = [tuple(item) for item in meta["bad"]]
    loaded.index_runs = meta.get("index") or {}
    records = loaded.records
    items = records._items
    if summaries is None:
        summaries, totals, code_array = [None], [None], None
    # Each row is a block of a merged file's members (v2: `shard` empty), a record in its own file (`file` empty)
    # or a record of a compacted shard (v1 only). Long runs of records in their own files become one `Loose`
    # each (columns, no object per record); blocks one object each; other rows a record each.
    block_rows = _empty(table.column("shard")) if members is not None else np.zeros(table.num_rows, dtype=bool)
    own_file = ~block_rows & _empty(table.column("file"))
    kinds = np.where(block_rows, 0, np.where(own_file, 1, 2)).astype(np.int8)
    starts = np.flatnonzero(np.diff(kinds)) + 1
    bounds_of_runs = [0, *starts.tolist(), len(kinds)]
    member_columns = table.select(MEMBER_FIELDS) if table.num_rows else None
    for low, high in zip(bounds_of_runs[:-1], bounds_of_runs[1:]):
        if low == high:
            continue
        kind = int(kinds[low])
        if kind == 1 and high - low >= LOOSE_MIN:
            records.add_block(Loose(member_columns.slice(low, high - low),
                                    None if code_array is None else code_array[low:high], summaries, totals,
                                    regular=meta.get("regular_records") is True))
            continue
        part = table.slice(low, high - low)
        if kind == 0:  # blocks of a merged file's members: one object each, not one per member
            for at_row, file, row_offset in zip(range(low, high), part.column("file").to_pylist(),
                                                part.column("row_offset").to_pylist()):
                first_member = bounds[at_row]
                records.add_block(Block(file, row_offset, members.slice(first_member, bounds[at_row + 1] - first_member)))
            continue
        columns = [_shared_strings(part.column(name)) if name in _FEW_VALUES else part.column(name).to_pylist()
                   for name in _MANIFEST_SCHEMA.names]
        row_codes = code_array[low:high].tolist() if code_array is not None else itertools.repeat(0)
        new = object.__new__
        for (shard, run_id, producer, chunk, count, size, sha256, at, file, row_offset), code in zip(zip(*columns), row_codes):
            # CommitRecord(...) without the frozen dataclass's per-field object.__setattr__ (~3x faster per record)
            record = items[shard] = new(CommitRecord)
            fields = record.__dict__
            (fields["shard"], fields["run_id"], fields["producer"], fields["chunk"], fields["rows"], fields["bytes"],
             fields["sha256"], fields["committed_at"], fields["skipped"], fields["file"], fields["row_offset"],
             fields["index"]) = (shard, run_id, producer, chunk, count, size, sha256, at, False, file, row_offset,
                                 summaries[code] if code and totals[code] == count else None)
    chunks = meta.get("chunks")
    if records.has_blocks and isinstance(chunks, dict):  # the blocks' producers and chunks, as saved with them (those
        # of `Loose` runs are worked out from their columns when first needed)
        records.set_chunk_ranges({p: (int(lo), int(hi)) for p, (lo, hi) in chunks["ranges"].items()}
                                 if chunks.get("regular") else None)
    loaded.rows = int(int64_values(table.column("rows")).sum())
    loaded.changed = list(items)
    loaded.checkpoint_changes = len(loaded.changed)
    return loaded


@dataclass(frozen=True)
class ShardProblem:
    """Something in a run that a reader cannot trust, and why (`kind`: missing, size, sha256, unreadable,
    torn-line, bad-line, unlogged, duplicate)."""

    path: str
    reason: str
    kind: str = "shard"


def shard_name(producer: str, chunk: int) -> str:
    """Deterministic file name of a chunk's shard."""
    return f"{producer}-{chunk:08d}.parquet"


def _check_name(kind: str, value: str) -> None:
    if not _NAME_PART.match(value):
        raise ValueError(
            f"{kind} {value!r} is not a valid name: use letters, digits, '_', '-', '.', '=' "
            "(at most 128 characters, starting with a letter or digit)"
        )


def _take_ranges(table: pa.Table, ranges: list[tuple[int, int]] | None) -> pa.Table:
    if ranges is None:
        return table
    return pa.concat_tables([table.slice(start, stop - start) for start, stop in ranges]) if ranges else table.slice(0, 0)


def _batches_in_ranges(batches: Iterable[pa.RecordBatch], ranges: list[tuple[int, int]]) -> Iterator[pa.RecordBatch]:
    """The rows of `batches` (a file read in order) that fall in the sorted `ranges`."""
    position = 0
    for batch in batches:
        end = position + batch.num_rows
        for start, stop in ranges:
            low, high = max(start, position), min(stop, end)
            if low < high:
                yield batch.slice(low - position, high - low)
        position = end


fsync_path = fsync_dir
"""fsync a file or a directory by path (a directory's fsync makes a rename inside it durable)."""


def staged_shard(name: str) -> str | None:
    """The shard a hidden temporary file `.<shard>.<nonce>.tmp` is being written for, or None."""
    if not (name.startswith(".") and name.endswith(".tmp")):
        return None
    shard = name[1:].rsplit(".", 2)[0]
    return shard if shard.endswith(".parquet") else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class _HashingFile(io.RawIOBase):
    """A write-only file that hashes the bytes it passes on (the shard's sha256 without reading it back)."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.digest, self.size = raw, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):  # a short write must not leave hashed bytes unwritten
            written += self.raw.write(view[written:])
        self.digest.update(view)
        self.size += written
        return written

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:  # the caller owns `raw`: it fsyncs and closes it
        super().close()


_VERIFIED: dict[tuple[str, int, int, int], str] = {}


def _verified_sha256(path: Path) -> str:
    """sha256 of a file, remembered per (path, inode, size, mtime) so unchanged shards are hashed once."""
    stat = path.stat()
    key = (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key not in _VERIFIED:
        _VERIFIED[key] = _sha256(path)
    return _VERIFIED[key]


_SYNCERS: dict[int, ThreadPoolExecutor] = {}
_SYNCERS_LOCK = threading.Lock()


def _syncer() -> ThreadPoolExecutor:
    """Threads that fsync a shards directory beside its shard's fsync, one pool per process (a forked child gets
    its own: the parent's threads do not exist there)."""
    pid = os.getpid()
    with _SYNCERS_LOCK:
        pool = _SYNCERS.get(pid)
        if pool is None:
            _SYNCERS.clear()
            pool = _SYNCERS[pid] = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fsync-dir")
        return pool


def _fsync_shard_and_dir(fd: int, directory: Path) -> None:
    """fsync a shard's temporary file and the directory holding its new name, the two at once; returns when both
    are durable (before a commit record may point at the name).

    Neither depends on the other, and each costs a journal commit and a device flush: one after the other they
    took ~4.0 ms on this machine's ext4 volume, issued together ~1.9 ms (a 320 KB file, median of 160; the
    directory's fsync in a helper thread). Raises the file's OSError, else the directory's, only once both ended."""
    directory_synced = _syncer().submit(fsync_dir, directory)
    try:
        os.fsync(fd)
    finally:
        error = directory_synced.exception()  # waits: nothing is left running when the file's fsync failed
    if error is not None:
        raise error


def _write_rows(path: Path, rows: pa.RecordBatch | pa.Table, row_group_groups: int,
                on_written: Callable[[], None] | None = None) -> tuple[int, int, str, dict[str, Any] | None]:
    """`_write_parquet` for rows already in GROUP_SCHEMA (the batching API's ingest path builds them directly).

    The rows are in memory already, so the file is encoded into an Arrow buffer (not through a Python file
    object, which costs a Python call and a GIL round trip per page: ~80 for a 4-group shard, each a wait for
    the GIL while the API's event loop and decoder hold it), then hashed and written in one call each."""
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, GROUP_SCHEMA, write_page_checksum=True, **PARQUET_OPTIONS) as writer:
        writer.write(rows, row_group_size=row_group_groups)
    data = memoryview(sink.getvalue())
    checksum = hashlib.sha256(data).hexdigest()  # lets go of the GIL on large data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        written = 0
        while written < len(data):  # a short write goes on where it stopped
            written += os.write(fd, data[written:])
        if on_written is not None:
            on_written()
        _fsync_shard_and_dir(fd, path.parent)  # the bytes and the temporary's name are durable before a record points at it
    finally:
        os.close(fd)
    return rows.num_rows, len(data), checksum, summarize_table(rows)


class ShardStore:
    """A directory of runs, each a set of committed Parquet shards of `ScoredGroup`s."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        root_str = os.fspath(root)
        if root_str.startswith("file://"):
            root_str = root_str[len("file://") :]
        if "://" in root_str:
            raise StoreError(
                f"store root {root_str!r} is a URL; the store commits by POSIX rename and fsync, "
                "so point it at a local or mounted (NFS, Lustre, GPFS) directory"
            )
        self.root = Path(root_str).expanduser().absolute()
        self.problems: list[ShardProblem] = []
        """Shards left out of the most recent reads, with the reason."""
        self._logs: dict[str, _LogTail] = {}
        self._logs_lock = threading.Lock()
        self._recovered: set[str] = set()
        """Runs whose interrupted commits this process has finished (once, at its first commit)."""

    filesystem = None
    """The pyarrow filesystem shard paths are read through: None, they are local paths (see `store_object`)."""

    # ---- paths ----
    def run_dir(self, run_id: str) -> Path:
        _check_name("run_id", run_id)
        return self.root / run_id

    def shards_dir(self, run_id: str) -> Path:
        return self.run_dir(run_id) / "shards"

    def shard_path(self, run_id: str, name: str) -> Path:
        """Where the file `name` (a shard, or a compacted file: `CommitRecord.physical`) of a run lives."""
        return self.shards_dir(run_id) / name

    @staticmethod
    def file_size(path: Path) -> int | None:
        """Bytes of the file at `path`, or None when it does not exist."""
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return None

    def shard_names(self, run_id: str) -> set[str]:
        """Names under the run's `shards/` (one listing: a follower's presence check for many shards at once)."""
        try:
            return set(os.listdir(self.shards_dir(run_id)))
        except FileNotFoundError:
            return set()

    def check(self) -> None:
        """Nothing to check up front on a local store (an object store checks its bucket here)."""

    def commit_log(self, run_id: str) -> Path:
        return self.run_dir(run_id) / "commits.jsonl"

    def runs(self) -> list[str]:
        """Runs that have a commit log, sorted by name."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if (p / "commits.jsonl").is_file())

    @contextmanager
    def _locked(self, run_id: str) -> Iterator[None]:
        run_dir = self.run_dir(run_id)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = open(run_dir / ".lock", "a")
        except OSError as error:
            raise _write_failure("opening the lock file", run_dir / ".lock", error) from error
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # ---- writing ----
    def commit(
        self,
        run_id: str,
        producer: str,
        chunk: int,
        groups: Iterable[ScoredGroup | dict[str, Any]],
        *,
        replace: bool = False,
        row_group_groups: int = 256,
        on_written: Callable[[], None] | None = None,
    ) -> CommitRecord:
        """Write `groups` as the shard of (run, producer, chunk) and commit it atomically.

        An already committed chunk is skipped (the returned record has
        `skipped=True`) unless `replace` is set. Dicts are validated as
        `ScoredGroup`s; a bad group raises before anything becomes visible.
        An empty chunk commits an empty shard, which marks the chunk done. An object with a `to_record_batch()`
        (a datagen chunk: tasks/group.GroupedChunk) is written from the batch it returns.
        `on_written` (rows given as a `pa.Table`, a `pa.RecordBatch` or `to_record_batch()` only) is called in this
        thread once the shard's bytes are encoded and handed to the OS, before they are fsynced and committed: what
        is left of the commit then mostly waits on the disk (the run-api starts encoding its next shard there).
        """
        _check_name("producer", producer)
        if chunk < 0:
            raise ValueError(f"chunk must be >= 0, got {chunk}")
        name = shard_name(producer, chunk)
        if not replace and (existing := self.record(run_id, name)) is not None:
            return replace_record(existing, skipped=True)

        shards = self.shards_dir(run_id)
        if not shards.is_dir():
            try:
                shards.mkdir(parents=True, exist_ok=True)
                fsync_dir(shards.parent)  # the new directory's name is durable before anything in it is committed
            except OSError as error:
                raise _write_failure("creating", shards, error) from error
        tmp = shards / f".{name}.{uuid.uuid4().hex[:12]}.tmp"
        logged = False
        try:
            try:
                rows, size, checksum, summary = self._write_parquet(tmp, groups, row_group_groups, on_written)
            except OSError as error:
                raise _write_failure("writing shard", tmp, error) from error
            record = CommitRecord(
                shard=name,
                run_id=run_id,
                producer=producer,
                chunk=chunk,
                rows=rows,
                bytes=size,
                sha256=checksum,
                committed_at=datetime.now(timezone.utc).isoformat(),
                index=summary,
            )
            with self._locked(run_id):
                if not replace and (existing := self.record(run_id, name)) is not None:
                    return replace_record(existing, skipped=True)
                if run_id not in self._recovered:
                    try:
                        self._finish_commits(run_id)
                        self._recovered.add(run_id)
                    except OSError as error:  # not this commit's business: tried again at the next one
                        logger.error("cannot finish interrupted commits of run %s yet: %s", run_id, error)
                if not tmp.exists():
                    raise StoreError(f"{tmp} vanished before its commit (was `repair` run while writers were active?); retry the chunk")
                try:
                    self._append_record(run_id, record.to_line(), "the commit record of shard " + name)
                except RecordMaybeLogged:
                    logged = True  # keep the temporary, so the commit can still be finished
                    raise
                logged = True
                self._publish(tmp, shards / name)
        finally:
            if not logged:
                tmp.unlink(missing_ok=True)
        logger.debug("committed %s (%d groups, %d bytes)", shards / name, rows, size)
        return record

    def _publish(self, tmp: Path, final: Path) -> None:
        """Rename a shard whose record is durable to its visible name (under the run's lock).

        The commit is already durable; a failure here is only logged: the next
        commit of the run in any process (or a reader that misses the shard)
        finishes the rename from the temporary file.
        """
        try:
            os.replace(tmp, final)
        except OSError as error:
            logger.error("shard %s is committed but could not be renamed into place yet (%s); the next commit or read finishes it", final, error)
            self._recovered.discard(final.parent.parent.name)

    def _finish_commits(self, run_id: str, *, remove_retired: bool = True) -> list[str]:
        """Rename logged shards still under their temporary name into place (under the run's lock).

        A commit (or compaction) interrupted after its record became durable
        (a crash, a failed rename) left its file only as `.<name>.<nonce>.tmp`;
        the one whose size and sha256 match the log is the committed file.
        Then shard files that a logged compaction merged into a file now in
        place are removed (a compaction interrupted before it removed them).
        Returns the files renamed.
        """
        shards = self.shards_dir(run_id)
        try:
            staged = [(entry, staged_shard(entry.name)) for entry in os.scandir(shards) if entry.name.endswith(".tmp")]
        except FileNotFoundError:
            return []
        staged = [(entry, shard) for entry, shard in staged if shard]
        log = self._read_log(run_id)
        finished = []
        for entry, shard in staged:
            expected = log.physical(shard)
            final = shards / shard
            if expected is None or shard in finished or self._check_file(final, *expected, True) is None:
                continue
            tmp = Path(entry.path)
            try:
                if tmp.stat().st_size != expected[0] or _sha256(tmp) != expected[1]:
                    continue
                os.replace(tmp, final)
            except OSError as error:
                logger.error("cannot finish the commit of %s from %s: %s", final, tmp, error)
                continue
            finished.append(shard)
            logger.warning("finished an interrupted commit: renamed %s to %s", tmp.name, final)
        if finished:
            fsync_dir(shards)
        if remove_retired:
            self._remove_retired(run_id)
        return finished

    def _remove_retired(self, run_id: str) -> list[str]:
        """Remove shard files whose rows a logged compaction moved into a file that is in place and intact
        (under the run's lock). Returns the files removed."""
        log = self._read_log(run_id)
        if not log.files:
            return []
        shards = self.shards_dir(run_id)
        removed = []
        intact: dict[str, bool] = {}
        try:  # the directory, not the history: after a compaction it holds few files
            present = [entry.name for entry in os.scandir(shards) if entry.name.endswith(".parquet")]
        except FileNotFoundError:
            return []
        for shard in present:
            record = log.records.get(shard)
            if record is None or not record.file or log.physical(shard) is not None:
                continue
            path = shards / shard
            if record.file not in intact:
                intact[record.file] = self._check_file(shards / record.file, *log.files[record.file][:2], True) is None
            if not intact[record.file]:
                continue
            try:
                path.unlink()
            except OSError as error:
                logger.error("cannot remove %s (merged into %s): %s", path, record.file, error)
                continue
            removed.append(shard)
        if removed:
            fsync_dir(shards)
            logger.info("removed %d shard files merged into compacted files", len(removed))
        return removed

    def finish_commits(self, run_id: str) -> list[str]:
        """Rename committed shards left under their temporary name (a crash or failed rename) into place."""
        with self._locked(run_id):
            return self._finish_commits(run_id)

    def _append_record(self, run_id: str, line: bytes, what: str) -> None:
        """Append one record (`what`, for the message) to the run's commit log; StoreError if it failed,
        RecordMaybeLogged if it may be in the log all the same. Either way the cached log is dropped."""
        try:
            append_line(self.commit_log(run_id), line)
        except LogUncertain as error:
            self._forget_log(run_id)
            raise RecordMaybeLogged(str(error), error.errno) from error
        except OSError as error:
            self._forget_log(run_id)
            raise _write_failure(f"appending {what} to", self.commit_log(run_id), error) from error

    def _forget_log(self, run_id: str) -> None:
        with self._logs_lock:
            self._logs.pop(run_id, None)

    @staticmethod
    def _write_parquet(
        path: Path, groups: Iterable[ScoredGroup | dict[str, Any]], row_group_groups: int,
        on_written: Callable[[], None] | None = None,
    ) -> tuple[int, int, str, dict[str, Any] | None]:
        """Write and fsync the shard file and its directory (its new name); returns (rows, bytes, sha256 of the
        bytes written, the rows' index columns as runs for the commit record, see factory/index_runs.py).

        The checksum is taken from the bytes as they go to the file, not by reading the file back: the
        commit record still names exactly what was written and fsynced, without a second pass over it.
        """
        if isinstance(groups, (pa.RecordBatch, pa.Table)):
            return _write_rows(path, groups, row_group_groups, on_written)
        if callable(to_record_batch := getattr(groups, "to_record_batch", None)):  # a datagen chunk, built as columns
            return _write_rows(path, to_record_batch(), row_group_groups, on_written)  # the file the loop below writes
        rows = 0
        pending: list[ScoredGroup] = []
        index_rows: tuple[list[Any], ...] = ([], [], [], [])
        with open(path, "wb") as raw:
            handle = _HashingFile(raw)
            writer = pq.ParquetWriter(handle, GROUP_SCHEMA, write_page_checksum=True, **PARQUET_OPTIONS)
            try:
                for index, group in enumerate(groups):
                    if not isinstance(group, ScoredGroup):
                        try:
                            group = ScoredGroup.model_validate(group)
                        except ValidationError as error:
                            raise ValueError(
                                f"group {index} of the chunk is invalid: {describe_validation_error(error)}"
                            ) from None
                    pending.append(group)
                    for column, value in zip(index_rows, (group.env, group.env_id, group.policy_version, group.group_size)):
                        column.append(value)
                    if len(pending) >= row_group_groups:  # one row group converted to Arrow at a time: bounded memory
                        writer.write_batch(groups_to_record_batch(pending), row_group_size=row_group_groups)
                        rows += len(pending)
                        pending.clear()
                if pending or rows == 0:
                    writer.write_batch(groups_to_record_batch(pending), row_group_size=row_group_groups)
                    rows += len(pending)
            finally:
                writer.close()
            raw.flush()
            _fsync_shard_and_dir(raw.fileno(), path.parent)
        return rows, handle.size, handle.digest.hexdigest(), summarize_rows(*index_rows)

    def write_run_file(self, run_id: str, name: str, text: str) -> Path:
        """Atomically write a small file next to a run's shards (resolved config, stats)."""
        _check_name("file name", name)
        run_dir = self.run_dir(run_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".{name}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, run_dir / name)
        except OSError as error:
            raise _write_failure("writing", run_dir / name, error) from error
        finally:
            tmp.unlink(missing_ok=True)
        return run_dir / name

    # ---- the commit log ----
    def committed(self, run_id: str) -> dict[str, CommitRecord]:
        """Committed shards of a run by name, in commit order; the latest record of a shard wins.

        The log is append-only, so each call parses only the lines appended since the last call (a
        long-running writer or follower would otherwise re-read a log that grows with every commit), and a
        new process starts from the run's manifest (a checkpoint of the parsed log) plus the log after it.
        A compacted shard's record names the file holding its rows (`file`, `row_offset`).
        """
        return self._read_log(run_id).records.as_dict()

    def record(self, run_id: str, shard: str) -> CommitRecord | None:
        """The commit record of one shard, or None (reads only the log's new end; no copy of the history)."""
        return self._read_log(run_id).records.get(shard)

    def changes(self, run_id: str, cursor: tuple[int, int] | None = None) -> tuple[tuple[int, int], list[CommitRecord]]:
        """Records added or changed (committed, replaced, compacted) since `cursor` (None: every record).

        Returns (the cursor to pass next time, the current records of those shards in change order, each once).
        A follower that keeps the cursor costs what is new, not the history. After the log was re-read from
        its start (rewritten by repair) an old cursor yields every record again.
        """
        cursor, items = self.changed_items(run_id, cursor)
        records: list[CommitRecord] = []
        for item in items:
            if type(item) in GROUPED:
                records.extend(item.records())
            else:
                records.append(item)
        return cursor, records

    def changed_items(self, run_id: str, cursor: tuple[int, int] | None = None) -> tuple[tuple[int, int], list[Any]]:
        """`changes`, with the members of a compacted file that the run's manifest holds as a block given as that
        `Block` (file, first row, member columns), not as a record each: a follower indexes it whole; and the
        records not compacted that it holds as a `Loose` run (member columns, each its own file) given as that."""
        log = self._read_log(run_id)
        end = len(log.changed)
        since = cursor[1] if cursor is not None and cursor[0] == log.generation and cursor[1] <= end else 0
        items = log.records._items
        if since == 0 and end == len(items) and log.changed == list(items):
            # every key once, in the records' order (a log loaded from its manifest, nothing changed since): the
            # records themselves, without a dedupe dict of a million keys (one C-level compare of the names)
            return (log.generation, end), list(items.values())
        seen: dict[str, Any] = {}
        for key in log.changed[since:end]:
            item = items.get(key)
            if item is None:
                item = log.records.get(key)
                if item is None:
                    continue
            seen.pop(key, None)
            seen[key] = item
        return (log.generation, end), list(seen.values())

    def index_summary(self, run_id: str, file: str) -> dict[str, Any] | None:
        """The index columns of a compacted file as runs, if its compaction recorded them (factory/index_runs.py)."""
        return self._read_log(run_id).index_runs.get(file)

    def current(self, run_id: str) -> Records:
        """The run's current records as this store object has parsed them now (the mapping itself, not a copy: a
        start-up that looks up every indexed shard reads the log once, not once per shard)."""
        return self._read_log(run_id).records

    def compacted(self, run_id: str) -> bool:
        """Whether a compaction of the run is logged (as this store object has parsed the log now): if not, every
        committed shard is in its own file (no record names another file, see `_LogTail.compact`)."""
        return bool(self._read_log(run_id).files)

    def where(self, run_id: str, shard: str) -> tuple[str, int] | None:
        """(name of the file holding a committed shard's rows, first row in it), or None; no record is made."""
        return self._read_log(run_id).records.where(shard)

    def locate(self, run_id: str, shard: str) -> tuple[Path, int, int] | None:
        """(file, first row, rows) holding a committed shard's rows, following compaction; None if not committed."""
        record = self.record(run_id, shard)
        if record is None:
            return None
        return self.shards_dir(run_id) / record.physical, record.row_offset, record.rows

    def _read_log(self, run_id: str, *, checkpoint: bool = True) -> _LogTail:
        """The run's log as parsed so far, read on from where this store left it; `checkpoint=False`: never save
        the manifest here (a compaction reads the log once per merged file and saves it once at its end)."""
        log_path = self.commit_log(run_id)
        try:
            stat = log_path.stat()
        except OSError:
            return _LogTail(0)
        with self._logs_lock:
            cached = self._logs.get(run_id)
            if cached is None or cached.inode != stat.st_ino or stat.st_size < cached.offset:
                cached = load_manifest(self.manifest_path(run_id), log_path, stat) or _LogTail(stat.st_ino)
                self._logs[run_id] = cached
            if stat.st_size > cached.offset:
                with open(log_path, "rb") as log:
                    if cached.offset:
                        log.seek(cached.offset - len(cached.tail))
                        if log.read(len(cached.tail)) != cached.tail:  # cut back and appended to since: start over
                            cached = _LogTail(stat.st_ino)
                            self._logs[run_id] = cached
                            log.seek(0)
                    data = log.read()
                end = data.rfind(b"\n") + 1
                for line in data[:end].splitlines():
                    cached.lines += 1
                    self._parse_line(log_path, cached, line)
                cached.offset += end
                cached.tail = (cached.tail + data[:end])[-_LogTail.TAIL :]
                cached.torn = len(data) - end
                if cached.torn:
                    logger.warning("%s:%d: ignoring a torn last line (crash during append)", log_path, cached.lines + 1)
                grown = cached.lines - cached.checkpoint_lines >= max(MANIFEST_EVERY_LINES, cached.checkpoint_lines // 4)
                moved = len(cached.changed) - cached.checkpoint_changes
                if checkpoint and (grown or moved >= max(MANIFEST_EVERY_LINES, len(cached.records) // 4)):
                    # a few compaction lines that moved many shards count too: the next start-up loads the records
                    # as they stand instead of applying every member of those lines again
                    save_manifest(self.manifest_path(run_id), cached)
            return cached

    def manifest_path(self, run_id: str) -> Path:
        return self.run_dir(run_id) / MANIFEST_NAME

    @staticmethod
    def _parse_line(log_path: Path, cached: _LogTail, line: bytes) -> None:
        if not line.strip():
            return
        try:
            data = decode_line(line)
        except CommitLineError as error:
            salvaged = salvage_line(line)
            cached.bad.append((cached.lines, str(error), salvaged is not None))
            if salvaged is None:
                logger.error("%s:%d: unreadable commit record left out: %s", log_path, cached.lines, error)
                return
            data = salvaged
            logger.warning("%s:%d: a whole record follows a torn fragment on this line: kept it", log_path, cached.lines)
        if "compact" in data:
            try:
                cached.compact(data)
            except (KeyError, TypeError, ValueError) as error:
                cached.bad.append((cached.lines, f"not a compaction record: {error}", False))
                logger.error("%s:%d: unreadable compaction record left out: %s", log_path, cached.lines, error)
            return
        try:
            record = CommitRecord.from_dict(data)
        except CommitLineError as error:
            cached.bad.append((cached.lines, str(error), False))
            logger.error("%s:%d: unreadable commit record left out: %s", log_path, cached.lines, error)
            return
        cached.put(record)

    def is_committed(self, run_id: str, producer: str, chunk: int) -> bool:
        return self.record(run_id, shard_name(producer, chunk)) is not None

    # ---- reading ----
    def shard_paths(self, run_id: str, *, checksum: bool = True) -> list[Path]:
        """Paths of a run's committed, intact shard files in commit order (a compacted file once, where its first
        shard was committed).

        Each is checked against its logged size and sha256 (a file already
        verified in this process, unchanged since, is not hashed again);
        problems go to `self.problems` and the log, and the file is left out.
        `checksum=False` checks sizes only, for callers that re-list often.
        """
        return [path for path, _ in self._live_files(run_id, checksum)]

    def _live_files(self, run_id: str, checksum: bool = True) -> list[tuple[Path, list[tuple[int, int]] | None]]:
        """(path, row ranges to read or None for all) of each intact live file, in commit order."""
        return list(self._iter_live_files(run_id, checksum))

    def _iter_live_files(self, run_id: str, checksum: bool = True) -> Iterator[tuple[Path, list[tuple[int, int]] | None]]:
        """`_live_files` one at a time: each file is checked (size, sha256) just before it is handed out, so a
        reader's first rows do not wait for every file of the run's history to be hashed."""
        self.problems = []
        shards = self.shards_dir(run_id)
        finished = False
        for name, size, sha256, ranges in self._read_log(run_id).iter_live():
            path = shards / name
            problem = self._check_file(path, size, sha256, checksum)
            if problem and not finished:
                # A commit in flight (its record is durable, the rename is next) or interrupted: wait for the
                # writer's lock and finish it if it was interrupted. Read-only stores just report it.
                finished = True
                try:
                    with self._locked(run_id):
                        self._finish_commits(run_id)
                except (OSError, StoreError):  # a read-only store: report the shard below
                    pass
                problem = self._check_file(path, size, sha256, checksum)
            if problem:
                self.problems.append(ShardProblem(str(path), problem, problem.split(" ", 1)[0]))
                logger.error("shard %s left out of reads: %s", path, problem)
            else:
                yield path, ranges

    @staticmethod
    def _check(path: Path, record: CommitRecord, checksum: bool) -> str | None:
        return ShardStore._check_file(path, record.bytes, record.sha256, checksum)

    @staticmethod
    def _check_file(path: Path, expected_bytes: int, expected_sha256: str, checksum: bool) -> str | None:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return "missing"
        if size != expected_bytes:
            return f"size is {size} bytes, commit log says {expected_bytes} (truncated or overwritten)"
        if checksum and _verified_sha256(path) != expected_sha256:
            return "sha256 differs from the commit log (corrupt)"
        return None

    def verify(self, run_id: str) -> list[ShardProblem]:
        """Full check of a run; every inconsistency is returned (and kept in `self.problems`).

        Finds damaged or torn commit-log lines, logged shards that are missing,
        of the wrong size or sha256, or unreadable, shards under the glob
        (`shards/*.parquet`) that no record commits, and group ids stored in
        more than one committed shard. `store_repair.repair` fixes what can be fixed.
        """
        _VERIFIED.clear()
        self._forget_log(run_id)
        log = self._read_log(run_id)
        problems = [
            ShardProblem(
                f"{self.commit_log(run_id)}:{line}",
                f"damaged commit record: {why}" + (" (a whole record after the fragment was kept)" if salvaged else ""),
                "bad-line",
            )
            for line, why, salvaged in log.bad
        ]
        if log.torn:
            problems.append(ShardProblem(
                f"{self.commit_log(run_id)}:{log.lines + 1}", f"torn last line of {log.torn} bytes (an interrupted append)", "torn-line"
            ))
        files = self._live_files(run_id)
        problems += self.problems
        seen: dict[str, str] = {}
        for path, ranges in files:
            try:
                ids = _take_ranges(pq.read_table(path, columns=["group_id"]), ranges).column(0).to_pylist()
            except (OSError, pa.ArrowException) as error:
                problems.append(ShardProblem(str(path), f"unreadable Parquet: {error}", "unreadable"))
                continue
            again: dict[str, int] = {}
            for group_id in ids:
                if group_id in seen:
                    again[seen[group_id]] = again.get(seen[group_id], 0) + 1
                else:
                    seen[group_id] = path.name
            for other, count in again.items():
                problems.append(ShardProblem(str(path), f"{count} group ids are also stored in {other} (duplicates)", "duplicate"))
        shards = self.shards_dir(run_id)
        if shards.is_dir():
            for path in sorted(shards.glob("*.parquet")):
                if log.physical(path.name) is not None:
                    continue
                if path.name in log.records:
                    problems.append(ShardProblem(
                        str(path), f"merged into {log.records[path.name].file} by a compaction, yet seen by glob readers (retired)", "retired"))
                else:
                    problems.append(ShardProblem(str(path), "not in the commit log, yet seen by glob readers (unlogged)", "unlogged"))
        for problem in problems:
            if problem not in self.problems:
                logger.error("%s: %s", problem.path, problem.reason)
        self.problems = problems
        return problems

    def iter_batches(
        self, run_id: str, *, columns: list[str] | None = None, batch_size: int = READ_BATCH_GROUPS
    ) -> Iterator[pa.RecordBatch]:
        """Stream a run's groups as Arrow record batches, one shard at a time.

        A shard whose pages fail their checksums is reported and skipped
        whole; batches already yielded from it are not taken back, so callers
        that need all-or-nothing per shard should use `iter_shard_batches`.
        """
        for path, ranges in self._iter_live_files(run_id):
            if ranges is None:
                yield from self._read_shard(path, columns, batch_size)
            else:  # a compacted file some of whose shards were replaced since: only the rows still committed
                yield from _batches_in_ranges(self._read_shard(path, columns, batch_size), ranges)

    def iter_shard_batches(
        self, path: Path, *, columns: list[str] | None = None, batch_size: int = READ_BATCH_GROUPS
    ) -> Iterator[pa.RecordBatch]:
        yield from self._read_shard(path, columns, batch_size)

    def _read_shard(self, path: Path, columns: list[str] | None, batch_size: int) -> Iterator[pa.RecordBatch]:
        try:
            parquet = pq.ParquetFile(path, page_checksum_verification=True)
            yield from parquet.iter_batches(batch_size=batch_size, columns=columns)
        except (OSError, pa.ArrowException) as error:
            problem = ShardProblem(str(path), f"unreadable: {error}")
            self.problems.append(problem)
            logger.error("shard %s left out of reads: %s", path, problem.reason)

    def iter_groups(self, run_id: str, *, validate: bool = False) -> Iterator[ScoredGroup]:
        """Stream a run's groups as `ScoredGroup`s in commit order."""
        for batch in self.iter_batches(run_id):
            yield from record_batch_to_groups(batch, validate=validate)

    def dataset(self, run_id: str) -> Any:
        """A `pyarrow.dataset` over the run's committed, intact shard files (a compacted file whole: a shard
        replaced after its compaction is read from both; use `iter_batches` for exactly the committed rows)."""
        import pyarrow.dataset as ds  # imported here: it pulls in pandas (~0.15 s), which nothing else of the store needs

        return ds.dataset([str(p) for p in self.shard_paths(run_id)], schema=GROUP_SCHEMA, format="parquet")

    def count(self, run_id: str) -> int:
        """Groups committed in a run (from the commit log; no shard is opened)."""
        return self._read_log(run_id).rows
