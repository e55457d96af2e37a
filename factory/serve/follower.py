"""Find shards committed to followed runs that the service has not indexed yet, and read their index columns."""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from factory.index_runs import INDEX_COLUMNS, rows_of, table_of, table_of_many
from factory.store import CommitRecord, StoreError
from factory.store_records import GROUPED, Block, Loose, Records, int64_values

if TYPE_CHECKING:
    from factory.store_object import StoreReader

logger = logging.getLogger(__name__)


@dataclass
class NewShard:
    run_id: str
    shard: str
    path: Path | str
    """Local path, or the object's path on the store's `filesystem`."""
    rows: int
    file_index: pa.Table
    """INDEX_COLUMNS of every row of `path` (the shards of one compacted file share one table: not a slice each)."""
    row_offset: int = 0
    """Where the shard's rows start in `path` (a compacted file holds many shards)."""
    index_offset: int | None = None
    """Where the shard's rows start in `file_index`, if not at `row_offset`: shards whose commit records carry their
    index summary share one table made from the summaries of a scan (`summarized_index`), not their files'."""

    @property
    def index_at(self) -> int:
        return self.row_offset if self.index_offset is None else self.index_offset

    @property
    def index(self) -> pa.Table:
        """INDEX_COLUMNS of the shard's own rows."""
        if self.index_at == 0 and self.file_index.num_rows == self.rows:
            return self.file_index
        return self.file_index.slice(self.index_at, self.rows)


@dataclass
class NewShards:
    """Consecutive members of a `Loose` run (each in its own file, its index from its commit record's summary, its
    file there) that the service has not indexed, taken together as columns: a start-up before compaction makes
    no `NewShard` per shard. Member i is shard `shards[i]` at `paths[i]`, rows `index_offset + starts[i] ..` of
    `file_index` (`rows[i]` of them)."""

    run_id: str
    shards: list[str]
    paths: list[str]
    rows: Any
    """numpy int64 array: rows of each member."""
    summaries: list[dict[str, Any]]
    """Each member's index summary (made into `file_index` with the scan's others, see `summarized_index`)."""
    file_index: pa.Table | None = None
    index_offset: int = 0
    keys: list[tuple[str, str]] | None = None
    """(run, shard) of each member, where the service made them."""

    def __len__(self) -> int:
        return len(self.shards)

    @property
    def total(self) -> int:
        return int(self.rows.sum())

    def members(self) -> list[NewShard]:
        """One `NewShard` each (for a caller that takes them one by one)."""
        shards, at = [], self.index_offset
        for name, path, rows in zip(self.shards, self.paths, self.rows.tolist()):
            shards.append(NewShard(self.run_id, name, path, rows, self.file_index, 0, at))
            at += rows
        return shards


@dataclass
class NewBlock:
    """Consecutive members of one compacted file that the service has not indexed, taken whole: rows
    `first .. first + rows` of `path`, member after member (`member_rows` each)."""

    run_id: str
    file: str
    path: Path | str
    first: int
    member_rows: Any
    """numpy int64 array: rows of each member."""
    file_index: pa.Table
    """INDEX_COLUMNS of every row of `path`."""
    block: Block

    @property
    def rows(self) -> int:
        return self.block.total


KnownBlocks = Mapping[tuple[str, str], list[tuple[int, int]]]
"""(run, merged file) -> row ranges of it that the service indexed as blocks."""


def covered(known_blocks: KnownBlocks | None, run_id: str, file: str, start: int, end: int) -> bool | None:
    """True if rows `start..end` of a merged file are inside one range the service indexed as a block, None if
    they overlap such ranges only in part, False if they overlap none."""
    spans = known_blocks.get((run_id, file)) if known_blocks else None
    if not spans:
        return False
    partly = False
    for low, high in spans:
        if low <= start and end <= high:
            return True
        if low < end and start < high:
            partly = True
    return None if partly else False


@dataclass
class Moved:
    """A known shard whose rows a compaction moved: they are now rows `row_offset..` of `path`."""

    run_id: str
    shard: str
    path: Path | str
    row_offset: int


LIST_AT = 256
"""A scan that meets this many new shards whose records carry their index summary lists the run's `shards/` once
and takes a shard's name there for its presence, instead of a stat each (~20 us: 20 s at a million shards)."""


def summaries_table(summaries: list[dict[str, Any]], rows: list[int]) -> tuple[pa.Table, list[int]]:
    """One index table made from shards' record summaries (in order, `rows` each) and where each shard starts in it."""
    starts, at = [], 0
    for count in rows:
        starts.append(at)
        at += count
    return table_of_many(summaries), starts


def summarized_index(shards: list[NewShard | NewShards], summaries: list[dict[str, Any]]) -> None:
    """Give `shards` (in order; a `NewShards` counts for its members) one index table made from their records'
    summaries, each its place in it."""
    if not shards:
        return
    table, starts = summaries_table(summaries, [shard.total if type(shard) is NewShards else shard.rows
                                                for shard in shards])
    for shard, at in zip(shards, starts):
        shard.file_index, shard.index_offset = table, at


class OwnFiles:
    """Shards in their own files whose records carry their index summary: their paths as strings (a Path costs ~4 us
    to build: seconds at a million shards) and whether each is there, by a size look each for the first LIST_AT of
    a run, then by one listing of the run's `shards/` (where the store can list it)."""

    def __init__(self, store: StoreReader, size_of: Callable[[Any], int | None] | None = None) -> None:
        self.store = store
        self.size_of = size_of or store.file_size
        self._list: Callable[[str], set[str]] | None = getattr(store, "shard_names", None)
        self._bases: dict[str, str] = {}
        self._looked: dict[str, int] = {}
        self._names: dict[str, set[str]] = {}

    def path(self, run_id: str, name: str) -> str:
        base = self._bases.get(run_id)
        if base is None:
            base = self._bases[run_id] = str(self.store.shard_path(run_id, "x"))[:-1]
        return base + name

    def base(self, run_id: str) -> str:
        """The run's shard paths without the name (a shard's path is this + its name)."""
        self.path(run_id, "")
        return self._bases[run_id]

    def present_many(self, run_id: str, names: list[str], sizes: list[int]) -> list[bool]:
        """`present` of each of `names` (`sizes` bytes each, in order): the same looks, without a path made for
        each once the run's listing is read."""
        found: list[bool] = []
        at = 0
        while at < len(names) and self._names.get(run_id) is None:
            found.append(self.present(run_id, names[at], self.path(run_id, names[at]), sizes[at]))
            at += 1
        if at < len(names):
            listed = self._names[run_id]
            found.extend([name in listed for name in (names[at:] if at else names)])
        return found

    def present(self, run_id: str, name: str, path: str, size: int) -> bool:
        """Whether shard `name` (at `path`, `size` bytes by its record) is there."""
        names = self._names.get(run_id)
        if names is None:
            looked = self._looked[run_id] = self._looked.get(run_id, 0) + 1
            if looked < LIST_AT or self._list is None:
                return self.size_of(path) == size
            names = self._names[run_id] = self._list(run_id)
        return name in names


def read_index(path: Path | str, filesystem: pa.fs.FileSystem | None = None) -> pa.Table:
    # ParquetFile, not pq.read_table: the latter imports pyarrow.dataset and pandas (~0.5 s of a start-up).
    with pq.ParquetFile(path, filesystem=filesystem) as parquet:
        return parquet.read(columns=INDEX_COLUMNS)


class Locator:
    """(file, first row) of committed shards' rows, following compaction, from one snapshot of each run's log.

    For a start-up that resolves every indexed shard: one read of each run's log state, one Path per file.
    """

    def __init__(self, store: StoreReader) -> None:
        self.store = store
        self._records: dict[str, Any] = {}
        self._paths: dict[tuple[str, str], Path | str] = {}
        self._own_files = OwnFiles(store)

    def _snapshot(self, run_id: str) -> Any:
        """The run's records, read once: `current` (Records) where the store has it, else `committed` (a dict)."""
        records = self._records.get(run_id)
        if records is None:
            current = getattr(self.store, "current", None)
            records = self._records[run_id] = current(run_id) if current is not None else self.store.committed(run_id)
        return records

    def locate(self, run_id: str, shard: str) -> tuple[Path | str, int]:
        where = getattr(self.store, "where", None)
        if where is not None:  # a local store: no record made (nor a copy of every record, blocks included)
            if getattr(self.store, "current", None) is not None:  # from one snapshot (not a stat of the log each)
                found = self._snapshot(run_id).where(shard)
            else:
                found = where(run_id, shard)
            name, offset = found if found is not None else (shard, 0)
        else:
            record = self._snapshot(run_id).get(shard)
            name, offset = (record.physical, record.row_offset) if record is not None else (shard, 0)
        path = self._paths.get((run_id, name))
        if path is None:
            path = self._paths[(run_id, name)] = self.store.shard_path(run_id, name)
        return path, offset

    def own_file(self, run_id: str, shard: str, rows: int) -> tuple[str, dict[str, Any]] | None:
        """(path, index summary) of a shard in its own file, from its commit record, if the record carries a summary
        of `rows` rows and the file is there (`OwnFiles`, as `scan_new_shards` looks); else None (the caller
        locates and reads the file, and reports it if it is gone). A shard that is not a record of its own in
        `Records` (absent, or a member of a compacted block) is not in its own file: this looks in the plain dict
        of records and the `Loose` runs of them, not into the compacted blocks."""
        records = self._snapshot(run_id)
        record = records.own(shard) if type(records) is Records else records.get(shard)
        if record is None or record.index is None or record.file or record.rows != rows:
            return None
        path = self._own_files.path(run_id, shard)
        return (path, record.index) if self._own_files.present(run_id, shard, path, record.bytes) else None


    def own_stretches(self, sources: list[tuple[int, str, str, int]], least: int = 64) -> list[OwnStretch]:
        """Stretches of `sources` ((source id, run, shard, rows) in order) that `own_file` would each find in its
        own file with its summary, as columns: consecutive ids, consecutive members of one `Loose` run of records
        (their names compared as lists, not looked up one by one), each of its record's rows, with a summary, its
        file there. Stretches shorter than `least` are left to `own_file`."""
        import numpy as np

        stretches: list[OwnStretch] = []
        if not sources:
            return stretches
        ids, runs, names, rows = (list(column) for column in zip(*sources))
        count = len(sources)
        at = 0
        while at < count:
            run_id = runs[at]
            records = self._snapshot(run_id)
            plain = type(records) is not Records or names[at] in records._items  # a record of its own, or no Records
            hit = None if plain else records._in_blocks(names[at])
            if hit is None or type(hit[0]) is not Loose or hit[0].codes is None:
                at += 1
                continue
            item, first = hit
            members = item.names()

            def same(length: int) -> bool:
                return (ids[at + length - 1] - ids[at] == length - 1
                        and names[at:at + length] == members[first:first + length]
                        and runs[at:at + length].count(run_id) == length)

            length = min(len(item) - first, count - at)
            if not same(length):  # the longest stretch that is (binary search: each test holds for its prefixes)
                low, high = 1, length - 1
                while low < high:
                    middle = (low + high + 1) // 2
                    low, high = (middle, high) if same(middle) else (low, middle - 1)
                length = low
            if length < least:
                at += length
                continue
            span = slice(first, first + length)
            member_rows, codes = item.rows[span], item.codes[span]
            totals = np.array([-1 if total is None else total for total in item.totals], dtype=np.int64)
            good = (codes != 0) & (totals[codes] == member_rows) & (member_rows == np.array(rows[at:at + length]))
            looks = np.flatnonzero(good)
            if len(looks):
                sizes = int64_values(item.members.column("bytes"))[span]
                there = self._own_files.present_many(run_id, [members[first + i] for i in looks.tolist()],
                                                      sizes[looks].tolist())
                good[looks[~np.array(there, dtype=bool)]] = False
            cuts = np.flatnonzero(good[1:] != good[:-1]) + 1
            base, summaries = self._own_files.base(run_id), item.summaries
            for low, high in zip([0, *cuts.tolist()], [*cuts.tolist(), length]):
                if good[low] and high - low >= least:
                    part = names[at + low:at + high]
                    stretches.append(OwnStretch(at + low, at + high, ids[at + low], run_id, part,
                                                [base + name for name in part], member_rows[low:high],
                                                [summaries[code] for code in codes[low:high].tolist()]))
            at += length
        return stretches


@dataclass
class OwnStretch:
    """Sources `start .. stop` (positions in the list given to `Locator.own_stretches`), ids `first ..`: shards in
    their own files, whose index is their summary."""

    start: int
    stop: int
    first: int
    run_id: str
    shards: list[str]
    paths: list[str]
    rows: Any
    """numpy int64 array."""
    summaries: list[dict[str, Any]]


class IndexCache:
    """Index columns of recently read files, so the shards of one compacted file cost one read of it."""

    def __init__(self, files: int = 8, filesystem: pa.fs.FileSystem | None = None) -> None:
        self.files = files
        self.filesystem = filesystem
        self._tables: OrderedDict[Path | str, pa.Table] = OrderedDict()
        self.preloaded: dict[Path | str, pa.Table] = {}
        """Index columns read ahead (concurrently, see `scan_new_shards`), each used once."""

    def _read(self, path: Path | str) -> pa.Table:
        table = self.preloaded.pop(path, None)
        return table if table is not None else read_index(path, self.filesystem)

    def rows(self, path: Path | str, offset: int, rows: int) -> pa.Table:
        table = self.file(path, offset, rows)
        if offset == 0 and table.num_rows == rows:
            return table
        return table.slice(offset, rows)

    def file(self, path: Path | str, offset: int, rows: int, summary: dict[str, Any] | None = None) -> pa.Table:
        """Index columns of the whole file `path`, checked to hold rows `offset..offset + rows` (read once while
        it is among the last `files` read; a shard's own file is not kept). `summary`: the file's index as runs
        (its compaction record's), made into the columns instead of reading them."""
        table = self._tables.get(path)
        if table is None:
            table = table_of(summary) if summary is not None and rows_of(summary) >= offset + rows else self._read(path)
            if offset or table.num_rows != rows:  # a compacted file: its other shards come next
                self._tables[path] = table
                while len(self._tables) > self.files:
                    self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(path)
        if offset + rows > table.num_rows:
            raise OSError(f"{path} holds {table.num_rows} rows, the commit log puts rows {offset}..{offset + rows} in it")
        return table


_cursors: weakref.WeakKeyDictionary[StoreReader, dict[str, tuple[Any, set[str], list[Block]]]] = weakref.WeakKeyDictionary()
"""Per store object and run: the change-list cursor of the last scan and the shards (and blocks) it must look at
again."""


def runs_to_follow(store: StoreReader, follow: list[str], ingest_run: str) -> list[str]:
    """The ingest run first, then the configured runs ('*' = every run in the store)."""
    runs = [ingest_run]
    for run in store.runs() if "*" in follow else follow:
        if run not in runs:
            runs.append(run)
    return runs


def scan_new_shards(
    store: StoreReader, runs: list[str], known: Collection[tuple[str, str]], reported: set[str],
    moved: list[Moved] | None = None, known_blocks: KnownBlocks | None = None, together: bool = False,
) -> list[NewShard | NewShards | NewBlock]:
    """Committed, intact shards of `runs` not in `known`, in commit order; a bad shard is logged once and left out.

    `moved`, if given, gets the known shards whose rows a compaction moved into a merged file that is in place
    (their rows keep their numbers inside the shard: row r is row `row_offset + r` of the file).
    `known_blocks`: row ranges of merged files the caller indexed as blocks; shards inside them are known too.
    Members of a compacted file that the store holds as a block (a manifest's) and that none of this knows come
    as one `NewBlock`; where some of them are known, they come one by one as before.

    `together`: consecutive members of a `Loose` run of records (uncompacted shards, as columns) whose index is
    their record's summary and whose files are there come as one `NewShards` (else as a `NewShard` each).

    Each scan looks only at what the runs' logs added or changed since the previous scan with this store
    object (and at shards that could not be read then), not at the whole history.
    """
    found: list[NewShard | NewShards | NewBlock] = []
    indexes = IndexCache(filesystem=store.filesystem)
    sizes: dict[Path | str, int | None] = {}
    paths: dict[str, Path | str] = {}
    taken: dict[tuple[str, str], list[tuple[int, int]]] = {}
    """Row ranges of the blocks returned by this scan (a member of one also met as a record is not returned)."""

    def size_of(path: Path | str) -> int | None:
        """One look per file and scan (a stat, or a HEAD request on an object store; a merged file holds many)."""
        if path not in sizes:
            sizes[path] = store.file_size(path)
        return sizes[path]

    def path_of(run_id: str, name: str) -> Path | str:
        """One path object per file and scan (the members of a compacted file share it, and its hash)."""
        path = paths.get(name)
        if path is None:
            path = paths[name] = store.shard_path(run_id, name)
        return path

    own = OwnFiles(store, size_of)

    def finish_commits(run_id: str) -> None:
        """Committed, not yet renamed into place: a commit in flight (wait for it) or one cut short by a crash
        (finish it). Skipping it would let a retried post be stored a second time. Sizes are looked at again."""
        try:
            store.finish_commits(run_id)
        except (OSError, StoreError) as error:
            logger.error("cannot finish the interrupted commits of run %s: %s", run_id, error)
        sizes.clear()

    def report_once(what: str, path: Path | str, error: Exception) -> None:
        if str(path) not in reported:
            reported.add(str(path))
            logger.error("%s %s left out of serving: %s", what, path, error)

    def inside_blocks(run_id: str, file: str, start: int, end: int) -> bool:
        return covered(known_blocks, run_id, file, start, end) is True or covered(taken, run_id, file, start, end) is True

    def loose_together(run_id: str, item: Loose) -> Iterator[Any]:
        """`items_of` for a Loose run, as columns: the members it would take one by one (index from a summary,
        file there, not known) as a `NewShards` for each stretch of them, the records of the others (in order)."""
        import numpy as np

        names, rows, count = item.names(), item.rows, len(item)
        codes = item.codes
        totals = np.array([-1 if total is None else total for total in item.totals], dtype=np.int64)
        summarized = (codes != 0) & (totals[codes] == rows)
        unknown = (np.fromiter(((run_id, name) not in known for name in names), dtype=bool, count=count)
                   if known else np.ones(count, dtype=bool))
        looks = np.flatnonzero(summarized & unknown)
        take = np.zeros(count, dtype=bool)
        if len(looks):
            sizes = int64_values(item.members.column("bytes"))
            there = own.present_many(run_id, [names[at] for at in looks.tolist()], sizes[looks].tolist())
            take[looks[np.array(there, dtype=bool)]] = True
        cuts = np.flatnonzero(take[1:] != take[:-1]) + 1
        base, summaries_of = own.base(run_id), item.summaries
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), count]):
            if take[lo]:
                part = names[lo:hi]
                shards = NewShards(run_id, part, [base + name for name in part], rows[lo:hi],
                                   [summaries_of[code] for code in codes[lo:hi].tolist()])
                summarized_items.append(shards)
                summaries.extend(shards.summaries)
                found.append(shards)
                again.update(part)
                continue
            for at in range(lo, hi):
                if unknown[at]:
                    yield item.record(at)

    def items_of(run_id: str, items: list[Any]) -> Iterator[Any]:
        """Records, and blocks none of whose members is known yet (else their members' records)."""
        for item in items:
            if together and type(item) is Loose and item.codes is not None and len(item):
                yield from loose_together(run_id, item)
                continue
            if type(item) is Loose:  # records in their own files, loaded as columns: no record made for a member
                # known already, nor for one whose index is its summary and whose file is there (taken here, as
                # the loop below takes such a record); the others' records go through that loop
                for at, name, rows, size, summary in item.own_files():
                    if known and (run_id, name) in known:
                        continue
                    if summary is not None:
                        path = own.path(run_id, name)
                        if own.present(run_id, name, path, size):
                            shard = NewShard(run_id, name, path, rows, None, 0)
                            summarized_items.append(shard)
                            summaries.append(summary)
                            found.append(shard)
                            again.add(name)
                            continue
                    yield item.record(at)
                continue
            if type(item) is Block:
                state = covered(known_blocks, run_id, item.file, item.first, item.first + item.total)
                if state is True:
                    continue
                if state is None or (known and any((run_id, name) in known for name in item.names())):
                    yield from item.records()
                    continue
            yield item

    cursors = _cursors.setdefault(store, {})
    changed_items = getattr(store, "changed_items", None)
    index_summary = getattr(store, "index_summary", None)
    for run_id in runs:
        paths.clear()
        summarized_items: list[NewShard | NewShards] = []
        summaries: list[dict[str, Any]] = []
        cursor, retry, retry_blocks = cursors.get(run_id, (None, set(), []))
        cursor, changed = changed_items(run_id, cursor) if changed_items is not None else store.changes(run_id, cursor)
        pending = [record for shard in retry if (record := store.record(run_id, shard)) is not None]
        again: set[str] = set()
        """Shards to look at again next scan: unreadable ones, and those returned now (until the caller knows them:
        a caller that could not index one finds it again)."""
        again_blocks: list[Block] = []
        finished = False
        # each record once (the change list gives each once already: a dedupe only with shards looked at again)
        records = list({(r.key if type(r) in GROUPED else r.shard): r for r in retry_blocks + pending + changed}.values()
                       ) if retry_blocks or pending else changed
        if store.filesystem is not None:  # an object store: every look is a request, so make them concurrently
            _read_ahead(store, run_id, [r for item in records for r in (item.records() if type(item) is Loose else (item,))
                                        if type(r) is not Block and (run_id, r.shard) not in known and not r.file],
                        sizes, indexes)
        for record in items_of(run_id, records):
            if type(record) is Block:
                path = path_of(run_id, record.file)
                if not finished and size_of(path) is None:  # logged, not yet renamed into place: finish it
                    finished = True
                    finish_commits(run_id)
                try:
                    if size_of(path) is None:
                        raise FileNotFoundError(f"{path} does not exist")
                    index = indexes.file(path, record.first, record.total,
                                         index_summary(run_id, record.file) if index_summary else None)
                except (OSError, pa.ArrowException) as error:
                    again_blocks.append(record)
                    report_once("compacted file", path, error)
                    continue
                found.append(NewBlock(run_id, record.file, path, record.first, record.rows, index, record))
                again_blocks.append(record)
                taken.setdefault((run_id, record.file), []).append((record.first, record.first + record.total))
                continue
            name = record.shard
            if known and (run_id, name) in known:
                if moved is not None and record.file:
                    path = path_of(run_id, record.file)
                    if size_of(path) is None:
                        again.add(name)  # logged, not yet in place: look again next scan
                    else:
                        moved.append(Moved(run_id, name, path, record.row_offset))
                continue
            if record.file and inside_blocks(run_id, record.file, record.row_offset, record.row_offset + record.rows):
                continue  # indexed as a member of a block
            summary = record.index if not record.file else None
            if summary is not None:  # its index from its record: only its presence to check, not its columns
                path = own.path(run_id, name)
                if own.present(run_id, name, path, record.bytes):
                    shard = NewShard(run_id, name, path, record.rows, None, 0)  # its index: summarized_index
                    summarized_items.append(shard)
                    summaries.append(summary)
                    found.append(shard)
                    again.add(name)
                    continue
                # missing or of another size: as a shard without a summary (finish commits, then look and report)
            path = path_of(run_id, record.physical)
            if not finished and size_of(path) is None:
                finished = True
                finish_commits(run_id)
                record = store.record(run_id, name) or record
                path = path_of(run_id, record.physical)
            try:
                if not record.file:
                    size = size_of(path)
                    if size is None:
                        raise FileNotFoundError(f"{path} does not exist")
                    if size != record.bytes:
                        raise OSError(f"size is {size} bytes, commit log says {record.bytes}")
                summary = index_summary(run_id, record.file) if index_summary and record.file else None
                index = indexes.file(path, record.row_offset, record.rows, summary)
            except (OSError, pa.ArrowException) as error:
                again.add(name)
                report_once("shard", path, error)
                continue
            found.append(NewShard(run_id, name, path, record.rows, index, record.row_offset))
            again.add(name)
        summarized_index(summarized_items, summaries)
        cursors[run_id] = (cursor, again, again_blocks)
    return found


READ_AHEAD_THREADS = 16
"""Concurrent requests for the sizes and index columns of new shards on an object store (a cold start reads every
shard not yet compacted)."""


def _read_ahead(store: StoreReader, run_id: str, records: list[CommitRecord], sizes: dict[Path | str, int | None],
                indexes: IndexCache) -> None:
    """Fill `sizes` and `indexes.preloaded` for `records`' own files, READ_AHEAD_THREADS at a time. A file that
    cannot be read is left out: the scan looks at it again in order, and reports it."""
    paths = [store.shard_path(run_id, record.shard) for record in records]
    if len(paths) < 2:
        return
    summarized = {path for path, record in zip(paths, records) if record.index is not None}

    def look(path: Path | str) -> tuple[int | None, pa.Table | None] | None:
        try:  # a shard whose record carries its index: only its size
            return store.file_size(path), None if path in summarized else read_index(path, store.filesystem)
        except (OSError, pa.ArrowException, StoreError):
            return None

    with ThreadPoolExecutor(max_workers=min(READ_AHEAD_THREADS, len(paths))) as pool:
        for path, got in zip(paths, pool.map(look, paths)):
            if got is not None:
                sizes[path] = got[0]
                if got[1] is not None:
                    indexes.preloaded[path] = got[1]
