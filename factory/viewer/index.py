"""A per-run index of groups for the viewer: one small row per group, grown shard by shard as the commit log grows.

The index holds what filters and plots need (env, task family, difficulty,
policy version, scores, sequence lengths) and where each group lives (shard,
row), never tokens or text: about 150 bytes per group of 8. A refresh stats
the commit log and, when it grew, reads only the new lines and indexes only
the new shards (columns `group_id env item_key policy_version created_at
scores tokens`, the last one only for its list lengths). A shard whose size
differs from the commit log, or whose pages fail their checksums, is left out
and listed in `problems`.

Task family and difficulty are each env's own: difficulty is the shard's
`difficulty` column (what the env put in `item.info["difficulty"]`); the item
key is read only for the envs whose key format `KEY_LABELS` knows (InternBootcamp's
`family:difficulty:seed`, where the key also fills a difficulty missing from an
older shard; reasoning_gym's `rg:dataset:level:seed:index`; code_exec's
`code:problem:index`). Every other env's family is its name and its difficulty
only the column, so a `blackjack:SEED:INDEX` key never reads as difficulty SEED.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from factory.chunk_stats import VIEW_KEYS, segment_view
from factory.chunk_stats import parse_name as parse_stats_name
from factory.gc_pause import gc_paused
from factory.store import CommitRecord
from factory.store_object import StoreReader
from factory.store_records import GROUPED, Block, Loose
from factory.viewer.columns import Codes, Columns, ShardColumns, shard_columns, split_columns
from factory.viewer.query import Filters

logger = logging.getLogger(__name__)

INDEX_COLUMNS = ["group_id", "env", "item_key", "policy_version", "created_at", "scores", "tokens"]
TRAIN_METRICS_PATHS = ("train/metrics.jsonl", "metrics.jsonl")
"""Where a run's trainer metrics are looked up, relative to `<store>/<run>/`, first found wins."""
KEY_LABELS: dict[str, tuple[int, int | None, int | None]] = {
    "intern_bootcamp": (3, 0, 1),
    "reasoning_gym": (5, 1, 2),
    "code_exec": (3, 1, None),
}
"""env name -> (parts of its item key split on ':', part holding the task family, part holding the difficulty
or None); an env not listed has family = its name and difficulty from the `difficulty` column only."""


def index_shard(path: Path | str, shard_id: int, rows: tuple[int, int] | None = None,
                filesystem: pa.fs.FileSystem | None = None) -> pl.DataFrame:
    """The index rows of one shard: reads the small columns and the tokens column's list lengths.

    `rows` (first, count): only those rows of the file (a shard inside a compacted file), reading only the row
    groups that hold them; "row" is still the row in the file. `filesystem`: an object store's (None: a local path).
    """
    parquet = pq.ParquetFile(path, filesystem=filesystem, page_checksum_verification=True)
    if rows is None:
        return index_table(parquet.read(columns=_index_columns(parquet)), shard_id, 0)
    starts = row_group_starts(parquet.metadata)
    if not starts:
        return index_table(parquet.read(columns=_index_columns(parquet)), shard_id, 0).slice(rows[0], rows[1])
    low, high = _row_group_of(starts, rows[0]), _row_group_of(starts, max(rows[0], rows[0] + rows[1] - 1))
    table = parquet.read_row_groups(list(range(low, high + 1)), columns=_index_columns(parquet))
    return index_table(table.slice(rows[0] - starts[low], rows[1]), shard_id, rows[0])


def _index_columns(parquet: pq.ParquetFile) -> list[str]:
    return INDEX_COLUMNS + (["difficulty"] if "difficulty" in parquet.schema_arrow.names else [])


def row_group_starts(metadata: pq.FileMetaData) -> list[int]:
    """First row of each row group of a Parquet file."""
    starts, total = [], 0
    for number in range(metadata.num_row_groups):
        starts.append(total)
        total += metadata.row_group(number).num_rows
    return starts


def index_table(table: pa.Table, shard: int | pl.Series, first: int) -> pl.DataFrame:
    """Index rows of `table` (the INDEX_COLUMNS of rows `first`.. of a file): `shard` is the shard id of every
    row, or a series of one per row (rows of several shards of a compacted file read at once)."""
    has_difficulty = "difficulty" in table.schema.names
    tokens_type = table.schema.field("tokens").type
    tokens = table.column("tokens").combine_chunks() if table.num_rows else pa.array([], type=tokens_type)
    sequence_lengths = pc.list_value_length(tokens.flatten()).cast(pa.int32())
    offsets = pc.subtract(tokens.offsets, tokens.offsets[0]) if len(tokens) else pa.array([0], pa.int32())
    lengths = pa.ListArray.from_arrays(offsets, sequence_lengths)
    frame = pl.from_arrow(table.drop_columns(["tokens"]).append_column("lengths", lengths))
    assert isinstance(frame, pl.DataFrame)
    family, difficulty = label_expressions(has_difficulty)
    shard_column = shard.cast(pl.UInt32) if isinstance(shard, pl.Series) else pl.lit(shard, dtype=pl.UInt32)
    return frame.select(
        shard_column.alias("shard"),
        (pl.int_range(pl.len(), dtype=pl.UInt32) + first).cast(pl.UInt32).alias("row"),
        "group_id", "env", "item_key",
        family.alias("family"),
        difficulty.alias("difficulty"),
        "policy_version", "created_at", "scores", "lengths",
        pl.col("scores").list.len().cast(pl.Int32).alias("group_size"),
        pl.col("scores").list.mean().alias("score_mean"),
        pl.col("scores").list.min().alias("score_min"),
        pl.col("scores").list.max().alias("score_max"),
        pl.col("lengths").list.mean().alias("length_mean"),
    )


def label_expressions(has_difficulty_column: bool) -> tuple[pl.Expr, pl.Expr]:
    """(family, difficulty) of each row, from the env's own key format (KEY_LABELS) and difficulty column."""
    parts = pl.col("item_key").str.split(":")
    family: pl.Expr = pl.col("env")
    from_key: pl.Expr = pl.lit(None, dtype=pl.Int32)
    for env, (count, family_part, difficulty_part) in KEY_LABELS.items():
        match = (pl.col("env") == env) & (parts.list.len() == count)
        if family_part is not None:
            family = pl.when(match).then(parts.list.get(family_part, null_on_oob=True)).otherwise(family)
        if difficulty_part is not None:
            value = parts.list.get(difficulty_part, null_on_oob=True).cast(pl.Int32, strict=False)
            from_key = pl.when(match).then(value).otherwise(from_key)
    column = pl.col("difficulty").cast(pl.Int32, strict=False) if has_difficulty_column else None
    return family, (column.fill_null(from_key) if column is not None else from_key)


@dataclass
class ShardEntry:
    """A committed shard the index knows about."""

    shard_id: int
    record: CommitRecord
    path: Path
    rows: int
    row_group_starts: list[int] | None = None
    """First row of each Parquet row group (filled on first payload read)."""


class RunIndex:
    """The live index of one run; `refresh()` is cheap when the commit log has not changed."""

    def __init__(self, store: StoreReader, run_id: str) -> None:
        self.store = store
        self.run_id = run_id
        self.run_dir = _local_run_dir(store, run_id)
        self.shards: dict[str, ShardEntry] = {}
        self.by_id: list[ShardEntry] = []
        self.problems: dict[str, str] = {}
        self._frames: dict[str, pl.DataFrame] = {}
        self._columns_of: dict[str, ShardColumns] = {}
        self._frame: pl.DataFrame | None = None
        self._columns: Columns | None = None
        self._envs, self._families = Codes(), Codes()
        self._columns_built: tuple[list[str], Columns | None] = ([], None)
        self._cursor: tuple[int, int] | None = None
        self._seq = 0
        self._order: dict[str, int] = {}
        """Commit order of each indexed or pending shard (of a pending block: its first member's; member i is + i)."""
        self._pending: dict[str, CommitRecord | Block | Loose] = {}
        """Shards not indexed yet, in log order: records, and the members of merged files that the store's manifest
        holds as a `Block` (keyed by `Block.key`), which stay a block until indexed, newest members first; likewise
        the runs of records in their own files that it holds as a `Loose`."""
        self._pending_members = 0
        self._stats_key: tuple[tuple[str, tuple[int, int, int] | None], ...] = ()
        self._stats_files: dict[str, tuple[tuple[int, int, int] | None, dict[str, Any]]] = {}
        """Stats file name -> ((mtime, size, inode), its data) as last read: a refresh reads new and changed ones;
        a segment's (never rewritten) is (None, chunk -> its view)."""
        self.chunk_stats: dict[tuple[str, int], dict[str, Any]] = {}
        """(producer, chunk) -> what the viewer reads of its stats (`VIEW_KEYS`): the rest, e.g. the curriculum
        outcomes of every item (most of a file), is left out as it is read."""
        self.run_stats: dict[str, dict[str, Any]] = {}
        self._stats_answers: dict[str, tuple[Any, Any, Any]] = {}
        """drops() and flow_runs() as last computed, with the chunk_stats and run_stats dicts they came from."""
        self._metrics_key: tuple[str, int, int] | None = None
        self._metrics: list[dict[str, Any]] = []
        self._merged: dict[str, tuple[pq.FileMetaData, list[int]]] = {}
        """Footer and row-group starts of the compacted files read last (their names are never reused)."""
        self.lock = threading.RLock()

    # ---- keeping up with the commit log ----
    def refresh(self, budget_s: float | None = None) -> int:
        """Read new commit-log lines and index pending shards, newest first; returns how many groups were added.

        With `budget_s`, indexing stops once that many seconds have passed
        (at least one shard is indexed per call) and the rest stay `pending`,
        so a page of a huge, never-seen run answers at once; call again (the
        viewer does, from a background thread) to index the rest.
        """
        started = time.monotonic()
        with self.lock:
            self._read_log()
            added = indexed = 0
            while self._pending:
                if budget_s is not None and indexed and time.monotonic() - started > budget_s:
                    break
                name = next(reversed(self._pending))
                record = self._pending[name]
                if type(record) is Block:  # the newest members of a merged file's block: one read of their row groups
                    added += self._add_block(name, record)
                elif type(record) is Loose:  # the newest of a run of shards in their own files
                    added += self._add_loose(name, record)
                elif record.file:  # a compacted shard: it and its pending neighbours in the same row groups
                    added += self._add_merged(record)
                else:
                    self._unpend(name)
                    added += self._add(record)
                indexed += 1
                self._frame = self._columns = None
            self._refresh_stats()
            return added

    @property
    def pending(self) -> int:
        """Committed shards not indexed yet."""
        return self._pending_members

    def _unpend(self, name: str) -> None:
        item = self._pending.pop(name)
        self._pending_members -= len(item) if type(item) in GROUPED else 1

    def _read_log(self) -> None:
        # What the run's log added or changed since the last look (the store reads its manifest and the log after
        # it): a compaction shows up as its shards changed (their rows moved into a merged file) and re-indexes them.
        # A local store gives the members of merged files that its manifest holds as blocks whole (`changed_items`):
        # a new index keeps them as blocks, so its first page makes no record per member of the run's history.
        changed_items = getattr(self.store, "changed_items", None)
        cursor, items = (changed_items if changed_items is not None else self.store.changes)(self.run_id, self._cursor)
        if self._cursor is not None and cursor[0] != self._cursor[0]:
            self._reset()  # the log was re-read from its start (rewritten): every record comes again
        self._cursor = cursor
        if not (self.shards or self._frames or self._pending or self._columns_of):
            # a new index (the first page of a run): nothing to forget, `changes` lists each shard once
            pending, order, seq, members = self._pending, self._order, self._seq, 0
            for item in items:
                if type(item) in GROUPED:
                    pending[item.key] = item
                    order[item.key] = seq + 1
                    seq += len(item)
                    members += len(item)
                else:
                    seq += 1
                    pending[item.shard] = item
                    order[item.shard] = seq
                    members += 1
            self._seq, self._pending_members = seq, members
            return
        # A block after the first look would be the store's manifest re-read, which starts a new cursor generation
        # (reset above, so not this path); should one come, its members are taken one by one as before.
        records = [record for item in items for record in (item.records() if type(item) in GROUPED else (item,))]
        for record in records:
            # The latest record of a shard wins (a replaced chunk): forget what was indexed of it.
            self._seq += 1
            self._order[record.shard] = self._seq
            self._columns_of.pop(record.shard, None)
            if self.shards.pop(record.shard, None) is not None or self._frames.pop(record.shard, None) is not None:
                self._frame = self._columns = None
            if record.shard in self._pending:
                self._unpend(record.shard)
            self._pending[record.shard] = record
            self._pending_members += 1

    def _reset(self) -> None:
        self.shards.clear()
        self.by_id.clear()
        self.problems.clear()
        self._frames.clear()
        self._columns_of.clear()
        self._columns_built = ([], None)
        self._pending.clear()
        self._pending_members = 0
        self._order.clear()
        self._frame = self._columns = None
        self._cursor = None

    def _add(self, record: CommitRecord) -> int:
        path = self.store.shard_path(self.run_id, record.physical)
        self.problems.pop(str(path), None)
        size = self.store.file_size(path)
        if size is None:
            self.problems[str(path)] = "missing"
            return 0
        if size != record.bytes and not record.file:
            self.problems[str(path)] = f"size is {size} bytes, commit log says {record.bytes}"
            return 0
        shard_id = len(self.by_id)  # the id _register gives it
        try:
            if record.file:  # rows row_offset.. of a merged file; "row" stays the row in that file
                frame = index_shard(path, shard_id, (record.row_offset, record.rows), self.store.filesystem)
            else:
                frame = index_shard(path, shard_id, filesystem=self.store.filesystem)
        except (OSError, pa.ArrowException) as error:
            self.problems[str(path)] = f"unreadable: {error}"
            logger.error("shard %s left out of the viewer: %s", path, error)
            return 0
        self._register(record, path, frame, shard_columns(frame, self._envs, self._families))
        return frame.height

    def _register(self, record: CommitRecord, path: Path, frame: pl.DataFrame, columns: Any,
                  row_group_starts: list[int] | None = None) -> None:
        """An indexed shard (or member of a merged file): its entry, its frame and its columns, under its name."""
        entry = ShardEntry(len(self.by_id), record, path, record.rows, row_group_starts)
        self.by_id.append(entry)
        self.shards[record.shard] = entry
        self._frames[record.shard] = frame
        self._columns_of[record.shard] = columns

    def _read_row_groups(self, path: Path, metadata: pq.FileMetaData, low: int, high: int) -> pa.Table:
        """Row groups low..high of a merged file, the viewer's index columns only, its footer already parsed."""
        parquet = pq.ParquetFile(path, filesystem=self.store.filesystem, metadata=metadata,
                                 page_checksum_verification=True)
        return parquet.read_row_groups(list(range(low, high + 1)), columns=_index_columns(parquet))

    def _add_merged(self, record: CommitRecord) -> int:
        """Index a compacted shard together with the pending shards before it that lie in the same row groups of
        the merged file (a compaction lists its members in file order, so they are the next pending ones): one
        read of those row groups instead of one per shard, and the file's footer parsed once, not per shard."""
        path = self.store.shard_path(self.run_id, record.file)
        self.problems.pop(str(path), None)
        batch = [record]
        if self.store.file_size(path) is None:
            self._unpend(record.shard)
            self.problems[str(path)] = "missing"
            return 0
        try:
            metadata, starts = self._merged_metadata(path, record.file)
            if not starts:
                raise OSError(f"{path} holds no row groups")
            low = _row_group_of(starts, record.row_offset)
            high = _row_group_of(starts, max(record.row_offset, record.row_offset + record.rows - 1))
            first = starts[low]
            names = reversed(self._pending)
            next(names)
            for name in names:
                other = self._pending[name]
                if (type(other) in GROUPED or other.file != record.file or other.row_offset < first
                        or other.row_offset + other.rows != batch[-1].row_offset):
                    break  # another file, an earlier row group, or not the rows just before
                batch.append(other)
            table = self._read_row_groups(path, metadata, low, high)
        except (OSError, pa.ArrowException) as error:
            for member in batch:
                if member.shard in self._pending:
                    self._unpend(member.shard)
            self.problems[str(path)] = f"unreadable: {error}"
            logger.error("shards of %s left out of the viewer: %s", path, error)
            return 0
        batch.reverse()  # file order
        ids = np.repeat(np.arange(len(self.by_id), len(self.by_id) + len(batch), dtype=np.uint32),
                        [member.rows for member in batch])
        lead = batch[0].row_offset - first
        frame = index_table(table.slice(lead, len(ids)), pl.Series(ids), batch[0].row_offset)
        columns = split_columns(frame, [member.rows for member in batch], self._envs, self._families)
        added = 0
        for member, shard_cols in zip(batch, columns):
            self._unpend(member.shard)
            piece = frame.slice(member.row_offset - batch[0].row_offset, member.rows)
            self._register(member, path, piece, shard_cols, starts)
            added += piece.height
        return added

    def _add_block(self, key: str, block: Block) -> int:
        """Index the newest members of a pending block: those whose rows start in the row groups of the merged file
        that hold its last member (one read), each member's record made as it is indexed; the members before them
        stay pending as a smaller block (its first members: their commit order is unchanged)."""
        path = self.store.shard_path(self.run_id, block.file)
        self.problems.pop(str(path), None)
        if self.store.file_size(path) is None:
            self._unpend(key)
            self._order.pop(key, None)
            self.problems[str(path)] = "missing"
            return 0
        try:
            metadata, starts = self._merged_metadata(path, block.file)
            if not starts:
                raise OSError(f"{path} holds no row groups")
            last, count = int(block.offsets[-1]), int(block.rows[-1])
            low, high = _row_group_of(starts, last), _row_group_of(starts, max(last, last + count - 1))
            first = starts[low]
            split = min(int(np.searchsorted(block.offsets, first, side="left")), len(block) - 1)
            table = self._read_row_groups(path, metadata, low, high)
        except (OSError, pa.ArrowException) as error:
            self._unpend(key)
            self._order.pop(key, None)
            self.problems[str(path)] = f"unreadable: {error}"
            logger.error("shards of %s left out of the viewer: %s", path, error)
            return 0
        part = Block(block.file, int(block.offsets[split]), block.members.slice(split))
        records = part.records()
        sizes = part.rows.tolist()
        ids = np.repeat(np.arange(len(self.by_id), len(self.by_id) + len(records), dtype=np.uint32), sizes)
        frame = index_table(table.slice(part.first - first, part.total), pl.Series(ids), part.first)
        columns = split_columns(frame, sizes, self._envs, self._families)
        order = self._order[key] + split
        for number, (member, shard_cols) in enumerate(zip(records, columns)):
            self._register(member, path, frame.slice(member.row_offset - part.first, member.rows), shard_cols, starts)
            self._order[member.shard] = order + number
        if split:
            self._pending[key] = Block(block.file, block.first, block.members.slice(0, split))
            self._pending_members -= len(records)
        else:
            self._unpend(key)
            del self._order[key]
        return frame.height

    def _add_loose(self, key: str, loose: Loose) -> int:
        """Index the newest member of a pending `Loose` (its record made now, from a one-row slice of the columns);
        the members before it stay pending as a smaller `Loose` under the same key (their commit order unchanged)."""
        last = len(loose) - 1
        record = loose.slice(last).records()[0]
        order = self._order[key] + last
        if last:
            self._pending[key] = loose.slice(0, last)
            self._pending_members -= 1
        else:
            self._unpend(key)
            del self._order[key]
        self._order[record.shard] = order
        return self._add(record)

    def _merged_metadata(self, path: Path, name: str) -> tuple[pq.FileMetaData, list[int]]:
        """A compacted file's footer and row-group starts, read once while it is among the last few used."""
        cached = self._merged.pop(name, None)
        if cached is None:
            metadata = pq.read_metadata(path, filesystem=self.store.filesystem)
            cached = (metadata, row_group_starts(metadata))
            while len(self._merged) >= 8:
                self._merged.pop(next(iter(self._merged)))
        self._merged[name] = cached
        return cached

    def _refresh_stats(self) -> None:
        """Re-read the datagen stats files (per chunk, folded segments of chunks, per producer) when the set of them
        changed: only the ones new or changed since the last look (a live run adds one per chunk; re-reading every
        chunk's file each time grew with the run's history). Segments are write-once: cached by name, never
        stat'ed again; a chunk both in a segment and in its own file (a fold was interrupted) counts once."""
        names = sorted(path.name for path in self.run_dir.glob("stats-*.json")) if self.run_dir is not None else []
        listing: list[tuple[str, tuple[str, str, int], tuple[int, int, int] | None]] = []
        for name in names:
            if (parsed := parse_stats_name(name)) is None:
                continue
            if parsed[0] == "segment":
                listing.append((name, parsed, None))
                continue
            try:
                stat = (self.run_dir / name).stat()
            except FileNotFoundError:
                continue
            listing.append((name, parsed, (stat.st_mtime_ns, stat.st_size, stat.st_ino)))
        key = tuple((name, version) for name, _, version in listing)
        if key == self._stats_key:
            return
        self._stats_key = key
        chunk_stats: dict[tuple[str, int], dict[str, Any]] = {}
        run_stats: dict[str, dict[str, Any]] = {}
        known, self._stats_files = self._stats_files, {}
        chunk_files: list[tuple[str, int, dict[str, Any]]] = []
        with gc_paused():  # the parsed stats are kept: collections would walk them over and over
            for name, (kind, producer, chunk), version in listing:
                cached = known.get(name)
                if cached is not None and cached[0] == version:
                    data = cached[1]
                else:
                    try:
                        data = json.loads((self.run_dir / name).read_text(encoding="utf-8"))
                        if kind == "segment":
                            data = segment_view(data)
                        elif kind == "chunk":
                            data = {key: data[key] for key in VIEW_KEYS if key in data}
                    except (OSError, ValueError, AttributeError, TypeError):
                        continue
                self._stats_files[name] = (version, data)
                if kind == "segment":
                    chunk_stats.update({(producer, k): stats for k, stats in data.items()})
                elif kind == "chunk":
                    chunk_files.append((producer, chunk, data))
                else:
                    run_stats[producer] = data
        for producer, chunk, data in chunk_files:
            chunk_stats.setdefault((producer, chunk), data)  # a segment's copy first (the same content)
        # whole new dicts, never changed after: drops() and flow_runs() cache their answers on them
        self.chunk_stats, self.run_stats = chunk_stats, run_stats

    @property
    def frame(self) -> pl.DataFrame:
        """All indexed groups in commit order."""
        with self.lock:
            if self._frame is None:
                frames = [self._frames[name] for name in sorted(self._frames, key=self._order.__getitem__)]
                self._frame = pl.concat(frames, how="vertical_relaxed") if frames else _EMPTY
            return self._frame

    @property
    def columns(self) -> Columns:
        """All indexed groups as numpy columns, in commit order (the same order as `frame`)."""
        with self.lock:
            if self._columns is None:
                names = sorted(self._columns_of, key=self._order.__getitem__)
                built, previous = self._columns_built
                if previous is not None and names[: len(built)] == built:  # only new shards at the end
                    extra = [(self.shards[n].shard_id, self._columns_of[n]) for n in names[len(built):]]
                    self._columns = previous.append(Columns.concat(extra, self._envs, self._families))
                else:
                    self._columns = Columns.concat([(self.shards[n].shard_id, self._columns_of[n]) for n in names],
                                                   self._envs, self._families).with_capacity()
                self._columns_built = (names, self._columns)
            return self._columns

    # ---- what the pages ask ----
    def select(self, filters: Filters) -> np.ndarray | None:
        """Positions (in commit order) of the groups that pass the index-side filters; None for all."""
        mask = self.columns.mask(filters)
        return None if mask is None else np.flatnonzero(mask)

    def filtered(self, filters: Filters) -> pl.DataFrame:
        """The index rows that pass the index-side filters (for tests and notebooks; pages use `select`)."""
        positions = self.select(filters)
        return self.frame if positions is None else self.rows_at(positions)

    def rows_at(self, positions: np.ndarray | list[int]) -> pl.DataFrame:
        """Index rows at these positions, in the order given, gathered from each shard's small frame."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) == 0:
            return self.frame.clear()
        columns = self.columns
        shard_ids, rows = columns.shard[positions], columns.row[positions]
        frames_by_id = {entry.shard_id: self._frames[name]
                        for name, entry in self.shards.items() if name in self._frames}
        pieces, start = [], 0
        breaks = np.flatnonzero(np.diff(shard_ids)) + 1
        for end in [*breaks.tolist(), len(positions)]:
            pieces.append(frames_by_id[int(shard_ids[start])][rows[start:end].tolist()])
            start = end
        return pl.concat(pieces, how="vertical_relaxed") if len(pieces) > 1 else pieces[0]

    def drops(self) -> dict[str, Any]:
        """Kept and dropped groups by reason: summed over chunk stats, else the producer's summary. Computed once per
        set of stats files read (a run page asks on every render); do not change what it returns."""
        return self._stats_answer("drops", _drops)

    def flow_runs(self) -> list[dict[str, Any]]:
        """Prefect flow runs that committed this run's chunks (from `flow_run_id` in chunk stats), with chunk counts.
        Computed once per set of stats files read, as `drops`."""
        return self._stats_answer("flow_runs", _flow_runs)

    def _stats_answer(self, what: str, compute: Any) -> Any:
        chunk_stats, run_stats = self.chunk_stats, self.run_stats  # replaced whole by a refresh, never changed
        cached = self._stats_answers.get(what)
        if cached is not None and cached[0] is chunk_stats and cached[1] is run_stats:
            return cached[2]
        answer = compute(chunk_stats, run_stats)
        self._stats_answers[what] = (chunk_stats, run_stats, answer)
        return answer

    def train_metrics(self) -> tuple[Path | None, list[dict[str, Any]]]:
        """The trainer's per-step metrics (first of TRAIN_METRICS_PATHS that exists), re-read when it changes."""
        for relative in TRAIN_METRICS_PATHS if self.run_dir is not None else ():
            path = self.run_dir / relative
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            key = (str(path), stat.st_size, stat.st_mtime_ns)
            if key != self._metrics_key:
                rows = []
                for line in path.read_text(encoding="utf-8").splitlines():
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(row, dict):
                        rows.append(row)
                self._metrics_key, self._metrics = key, rows
            return path, self._metrics
        return None, []

    def read_table(self, shard_id: int, rows: list[int], columns: list[str]) -> pa.Table:
        """Columns of the given rows of one shard, in the order given, reading only the row groups that hold them."""
        entry = self.by_id[shard_id]
        metadata = self._merged_metadata(entry.path, entry.record.file)[0] if entry.record.file else None
        parquet = pq.ParquetFile(entry.path, filesystem=self.store.filesystem, metadata=metadata,
                                 page_checksum_verification=True)
        if entry.row_group_starts is None:
            entry.row_group_starts = row_group_starts(parquet.metadata)
        starts = entry.row_group_starts
        groups_of_rows = [_row_group_of(starts, row) for row in rows]
        needed = sorted(set(groups_of_rows))
        present = [c for c in columns if c in parquet.schema_arrow.names]
        table = parquet.read_row_groups(needed, columns=present)
        offsets, base = {}, 0
        for number in needed:
            offsets[number] = base
            base += parquet.metadata.row_group(number).num_rows
        local = [offsets[g] + row - starts[g] for g, row in zip(groups_of_rows, rows)]
        return table.take(_int64_indices(local))

    def read_rows(self, rows: pl.DataFrame, columns: list[str]) -> list[dict[str, Any]]:
        """Payload columns of the given index rows (shard, row) as dicts, in order, shard by shard."""
        wanted: dict[int, list[tuple[int, int]]] = {}
        for position, (shard_id, row) in enumerate(zip(rows["shard"].to_list(), rows["row"].to_list())):
            wanted.setdefault(shard_id, []).append((position, row))
        out: list[dict[str, Any]] = [{} for _ in range(rows.height)]
        for shard_id, items in wanted.items():
            picked = self.read_table(shard_id, [row for _, row in items], columns).to_pylist()
            for (position, _), values in zip(items, picked):
                out[position] = values
        return out


def _int64_indices(values: list[int]) -> pa.Array:
    """`pa.array(values)` without it: converting Python or numpy values makes pyarrow import pandas (~0.5 s, on the
    viewer's first page), building from a buffer does not."""
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(np.asarray(values, dtype=np.int64))])


def _row_group_of(starts: list[int], row: int) -> int:
    low, high = 0, len(starts) - 1
    while low < high:
        middle = (low + high + 1) // 2
        if starts[middle] <= row:
            low = middle
        else:
            high = middle - 1
    return low


_EMPTY = pl.DataFrame(schema={
    "shard": pl.UInt32, "row": pl.UInt32, "group_id": pl.String, "env": pl.String, "item_key": pl.String,
    "family": pl.String, "difficulty": pl.Int32, "policy_version": pl.Int64,
    "created_at": pl.Datetime("us", "UTC"), "scores": pl.List(pl.Float64), "lengths": pl.List(pl.Int32),
    "group_size": pl.Int32, "score_mean": pl.Float64, "score_min": pl.Float64, "score_max": pl.Float64,
    "length_mean": pl.Float64,
})


class StoreIndex:
    """The indexes of every run in a store, made on first use and refreshed on every look."""

    def __init__(self, store: StoreReader) -> None:
        self.store = store
        self._runs: dict[str, RunIndex] = {}
        self._lock = threading.Lock()

    def run_ids(self) -> list[str]:
        """Runs with a commit log or trainer metrics, sorted by name."""
        if self.store.filesystem is not None:  # an object store: its runs (trainer metrics are local files)
            return self.store.runs()
        if not self.store.root.is_dir():
            return []
        names = set(self.store.runs())
        for path in self.store.root.iterdir():
            if path.is_dir() and any((path / relative).is_file() for relative in TRAIN_METRICS_PATHS):
                names.add(path.name)
        return sorted(names)

    def has_metrics(self, run_id: str) -> bool:
        """Whether the run has trainer metrics, without indexing it."""
        run_dir = _local_run_dir(self.store, run_id)
        return run_dir is not None and any((run_dir / relative).is_file() for relative in TRAIN_METRICS_PATHS)

    def run(self, run_id: str, budget_s: float | None = None) -> RunIndex:
        """The run's index, refreshed (within `budget_s`, see `RunIndex.refresh`); KeyError for an unknown run."""
        if run_id not in self._runs and run_id not in self.run_ids():
            raise KeyError(run_id)
        with self._lock:
            index = self._runs.setdefault(run_id, RunIndex(self.store, run_id))
        index.refresh(budget_s)
        return index

    def indexed(self, run_id: str) -> RunIndex | None:
        """The run's index if one was made already (not refreshed)."""
        return self._runs.get(run_id)

    def commit_counts(self, run_id: str) -> tuple[int, int]:
        """(groups, shards) of a run from its commit log alone, without indexing it (a merged file's block of
        members counted whole, not a record made per member)."""
        changed_items = getattr(self.store, "changed_items", None)
        if changed_items is None:
            records = self.store.committed(run_id)
            return sum(r.rows for r in records.values()), len(records)
        _, items = changed_items(run_id)
        groups = shards = 0
        for item in items:
            if type(item) in GROUPED:
                groups, shards = groups + item.total, shards + len(item)
            else:
                groups, shards = groups + item.rows, shards + 1
        return groups, shards


def _drops(chunk_stats: dict[tuple[str, int], dict[str, Any]], run_stats: dict[str, dict[str, Any]]) -> dict[str, Any]:
    kept, dropped, chunks = 0, {}, []
    producers_with_chunks = {producer for producer, _ in chunk_stats}
    for (producer, chunk), stats in sorted(chunk_stats.items()):
        kept += int(stats.get("groups_kept", 0))
        for reason, count in (stats.get("dropped") or {}).items():
            dropped[reason] = dropped.get(reason, 0) + int(count)
        chunks.append({"producer": producer, "chunk": chunk, "kept": stats.get("groups_kept"),
                       "dropped": stats.get("dropped") or {}, "flow_run_id": stats.get("flow_run_id")})
    for producer, stats in run_stats.items():
        if producer in producers_with_chunks:
            continue
        kept += int(stats.get("groups_kept", 0))
        for reason, count in (stats.get("dropped") or {}).items():
            dropped[reason] = dropped.get(reason, 0) + int(count)
    recorded = bool(chunk_stats or run_stats)
    return {"kept": kept, "dropped": dropped, "chunks": chunks, "recorded": recorded}


def _flow_runs(chunk_stats: dict[tuple[str, int], dict[str, Any]],
               run_stats: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    runs: dict[str, dict[str, Any]] = {}
    for (producer, _chunk), stats in sorted(chunk_stats.items()):
        run_id = stats.get("flow_run_id")
        if run_id:
            entry = runs.setdefault(str(run_id), {"id": str(run_id), "producer": producer, "chunks": 0})
            entry["chunks"] += 1
    for producer, stats in run_stats.items():
        if (run_id := stats.get("flow_run_id")) and str(run_id) not in runs:
            runs[str(run_id)] = {"id": str(run_id), "producer": producer, "chunks": None}
    return list(runs.values())


def _local_run_dir(store: StoreReader, run_id: str) -> Path | None:
    """The run's directory on a local store, where datagen stats and trainer metrics live; None on an object store
    (it holds shards and commit records only, so the viewer shows no drop counts or training curves there)."""
    return store.run_dir(run_id) if store.filesystem is None else None  # type: ignore[attr-defined]
