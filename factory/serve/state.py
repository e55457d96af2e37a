"""Durable served-state of the batching API: a small SQLite file beside the store.

It records what a restart must not forget: the trainer's registration and
step, registered environments, which shards the service has indexed (in
arrival order), and every group taken from the queue with the step of the
batch it went into (or why it was skipped). Members of a compacted file found
together (a start-up after compaction) are indexed as one block: one row for a
run of consecutive source ids, one per member, in the file's member order. The queue itself is not stored:
on start it is rebuilt from the shards minus what was taken. WAL mode with
`synchronous=NORMAL` makes each commit survive a killed process (`kill -9`);
only an OS crash or power loss can lose the last few transactions.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, repeat
from pathlib import Path
from typing import Any

SKIPPED_STALE = -1
"""`taken.step` of a group skipped because its policy version was too old."""
DISCARDED = -2
"""`taken.step` of a group dropped by /reset_data."""
SKIPPED_OVERSIZE = -3
"""`taken.step` of a group with more sequences than the batch size."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS envs (env_id INTEGER PRIMARY KEY, info TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sources (
    source_id INTEGER PRIMARY KEY, run_id TEXT NOT NULL, shard TEXT NOT NULL, rows INTEGER NOT NULL,
    UNIQUE (run_id, shard));
CREATE TABLE IF NOT EXISTS source_blocks (
    first_source INTEGER PRIMARY KEY, run_id TEXT NOT NULL, file TEXT NOT NULL, first_row INTEGER NOT NULL,
    members INTEGER NOT NULL, member_rows BLOB NOT NULL, UNIQUE (run_id, file, first_row));
CREATE TABLE IF NOT EXISTS taken (
    source INTEGER NOT NULL, row INTEGER NOT NULL, step INTEGER NOT NULL, pos INTEGER NOT NULL,
    epoch INTEGER NOT NULL, PRIMARY KEY (source, row)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS ingested (group_id TEXT PRIMARY KEY) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS taken_step ON taken (epoch, step, pos);
"""


class TakenRows:
    """The groups taken (served or skipped) as numpy int64 arrays, ascending by (source, row): what a restart leaves
    out of the queue. Arrays, not a set per source: a restart after a long life reads millions of them (a set per
    source cost ~0.7 s a million, the arrays ~0.2 s)."""

    def __init__(self, sources: Any, rows: Any) -> None:
        import numpy as np

        self.sources, self.rows = sources, rows
        self._counts: dict[int, int] = {}
        if len(sources):
            firsts = np.concatenate(([0], np.flatnonzero(sources[1:] != sources[:-1]) + 1))
            self._counts = dict(zip(sources[firsts].tolist(), np.diff(np.append(firsts, len(sources))).tolist()))

    @classmethod
    def of(cls, taken: dict[int, Iterable[int]]) -> TakenRows:
        """From {source: rows} (tests)."""
        import numpy as np

        keys = sorted((source, row) for source, rows in taken.items() for row in rows)
        return cls(np.array([k[0] for k in keys], dtype=np.int64), np.array([k[1] for k in keys], dtype=np.int64))

    def __len__(self) -> int:
        return len(self.sources)

    def count(self, source: int) -> int:
        """Rows of `source` taken."""
        return self._counts.get(source, 0)


@dataclass(frozen=True)
class ShardRows:
    """Many shards, each in its own file, indexed as one entry of `add_sources` (`shards[i]` has `rows[i]` rows): one
    row each in `sources`, as separate entries would be, with no Python tuple made per shard by the caller."""

    shards: list[str]
    rows: list[int]


@dataclass(frozen=True)
class BlockRows:
    """What `add_sources` indexes for a block of a compacted file's members (its entry's name is the file): rows
    `first ..` of the file, `rows[i]` for member i, which gets the i-th source id of the block."""

    first: int
    rows: Any
    """numpy int64 array (numpy is imported only where blocks are: an idle service loads neither it nor pyarrow)."""

    @property
    def span(self) -> int:
        """Source ids the block takes (at least one, so an empty block still has an id of its own)."""
        return max(1, len(self.rows))


@dataclass
class SourceColumns:
    """The shards indexed one by one, in arrival order, as columns: ids, the run of each (a code into `runs`),
    shard names (an Arrow string array) and rows."""

    ids: Any
    runs: list[str]
    run_codes: Any
    shards: Any
    rows: Any


def _member_rows_blob(rows: Any) -> bytes:
    """A block's rows of each member as stored in `source_blocks.member_rows` (little-endian int64)."""
    import numpy as np

    return np.ascontiguousarray(rows, dtype="<i8").tobytes()


class ServedState:
    """Registration, envs, indexed shards and taken groups, persisted in one SQLite file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        # Freed pages are not zeroed (some builds turn that on): a fold that drops a million indexed shards would
        # otherwise rewrite every page they held.
        self.db.execute("PRAGMA secure_delete=OFF")
        self.db.executescript(_SCHEMA)

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One explicit transaction. The connection is in autocommit mode (`isolation_level=None`), where
        `with self.db:` opens none and every statement (every row of an executemany) would commit on its own."""
        self.db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # ---- key/value ----
    def get(self, key: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def put(self, **values: Any) -> None:
        with self._transaction():
            self.db.executemany(
                "INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                [(key, json.dumps(value)) for key, value in values.items()],
            )

    # ---- environments ----
    def envs(self) -> list[dict[str, Any]]:
        return [json.loads(info) for (info,) in self.db.execute("SELECT info FROM envs ORDER BY env_id")]

    def put_env(self, env: dict[str, Any]) -> None:
        with self._transaction():
            self.db.execute(
                "INSERT INTO envs (env_id, info) VALUES (?, ?) ON CONFLICT (env_id) DO UPDATE SET info = excluded.info",
                (env["registered_id"], json.dumps(env)),
            )

    # ---- shards ----
    def sources(self) -> list[tuple[int, str, str, int]]:
        """(source_id, run_id, shard, rows) in arrival order."""
        return list(self.db.execute("SELECT source_id, run_id, shard, rows FROM sources ORDER BY source_id"))

    def has_sources(self) -> bool:
        return self.db.execute("SELECT 1 FROM sources LIMIT 1").fetchone() is not None

    def source_runs(self) -> list[str]:
        """The runs that shards indexed one by one belong to."""
        return [run_id for (run_id,) in self.db.execute("SELECT DISTINCT run_id FROM sources")]

    def source_columns(self, runs: list[str] | None = None) -> SourceColumns | None:
        """`sources()` as columns, without a Python tuple per source (a restart after a compaction looks at a
        million of them once, see BatchService._fold); None where a shard name holds a line break (the columns
        come back as one line-separated text each), and the caller takes `sources()`. `runs`: `source_runs()`,
        where the caller has it already (each is a scan of the index)."""
        import numpy as np

        from factory.store_records import column_of_lines, int32_values

        many_runs = len(self.source_runs() if runs is None else runs) > 1
        count, ids, rows, shards, runs = self.db.execute(
            "SELECT COUNT(*), group_concat(source_id), group_concat(rows), group_concat(shard, char(10)), "
            f"{'group_concat(run_id, char(10))' if many_runs else 'MIN(run_id)'} "
            "FROM sources").fetchone()  # (a scan in id order, the rowid's: checked below, not asked for at a cost)
        if not count:
            return SourceColumns(np.zeros(0, np.int64), [], np.zeros(0, np.int32), column_of_lines(""),
                                 np.zeros(0, np.int64))
        names = column_of_lines(shards)
        if len(names) != count:
            return None
        ids_array = np.fromstring(ids, dtype=np.int64, sep=",")
        rows_array = np.fromstring(rows, dtype=np.int64, sep=",")
        if len(ids_array) != count or len(rows_array) != count or not (ids_array[1:] > ids_array[:-1]).all():
            return None  # (not in id order: the columns are not trusted)
        if many_runs:
            run_column = column_of_lines(runs).dictionary_encode()
            if len(run_column) != count:
                return None
            run_names, run_codes = run_column.dictionary.to_pylist(), int32_values(run_column.indices)
        else:
            run_names, run_codes = [runs], np.zeros(count, np.int32)
        return SourceColumns(ids_array, run_names, run_codes, names, rows_array)

    def add_source(self, run_id: str, shard: str, rows: int, group_ids: Iterable[str] = ()) -> int:
        """Index a committed shard (and note its posted group ids) in one transaction; returns its source id.

        Idempotent: a shard indexed before (by a transaction whose success was not reported) keeps its id.
        """
        with self._transaction():
            self.db.executemany("INSERT OR IGNORE INTO ingested (group_id) VALUES (?)", [(g,) for g in group_ids])
            self.db.execute("INSERT OR IGNORE INTO sources (source_id, run_id, shard, rows) VALUES (?, ?, ?, ?)",
                            (self._next_source(), run_id, shard, rows))
            (source,) = self.db.execute("SELECT source_id FROM sources WHERE run_id = ? AND shard = ?", (run_id, shard)).fetchone()
        return int(source)

    def source_blocks(self) -> list[tuple[int, str, str, int, Any]]:
        """(first source id, run_id, file, first row, rows of each member) of indexed blocks, in arrival order."""
        blocks = self.db.execute("SELECT COUNT(*) FROM source_blocks").fetchone()[0]
        if not blocks:
            return []
        import numpy as np

        return [(first, run_id, file, first_row, np.frombuffer(rows, dtype="<i8").astype(np.int64))
                for first, run_id, file, first_row, rows in self.db.execute(
                    "SELECT first_source, run_id, file, first_row, member_rows FROM source_blocks ORDER BY first_source")]

    def fold_sources(self, blocks: Sequence[tuple[int, str, str, int, Any]],
                     kept: Sequence[int] | None = None) -> None:
        """Replace runs of shards indexed one by one by blocks, in one transaction: each (first source id, run_id,
        file, first row, rows of each member) stands for the sources `first ..` (consecutive ids, the members of
        a compacted file in its order); their ids, and so the groups taken from them, stay as they are. `kept`:
        the ids of every source no block stands for, where the caller knows them: if they are fewer than those
        folded, the table is emptied at once and they are put back (a delete row by row, with its index, cost
        ~0.3 s per 200k sources)."""
        folded = sum(len(rows) for *_, rows in blocks)
        with self._transaction():
            self.db.executemany(
                "INSERT INTO source_blocks (first_source, run_id, file, first_row, members, member_rows) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [(first, run_id, file, first_row, len(rows), _member_rows_blob(rows))
                 for first, run_id, file, first_row, rows in blocks])
            if kept is not None and len(kept) <= folded:
                left = self.db.execute(
                    "SELECT source_id, run_id, shard, rows FROM sources "
                    "WHERE source_id IN (SELECT value FROM json_each(?))",
                    (json.dumps([int(source) for source in kept]),)).fetchall()
                self.db.execute("DELETE FROM sources")  # (no WHERE: SQLite drops the pages, not row by row)
                self.db.executemany("INSERT INTO sources (source_id, run_id, shard, rows) VALUES (?, ?, ?, ?)", left)
            else:
                self.db.executemany("DELETE FROM sources WHERE source_id BETWEEN ? AND ?",
                                    [(first, first + len(rows) - 1) for first, _, _, _, rows in blocks])

    def _insert_sources(self, shards: Sequence[tuple[str, str, int | BlockRows | ShardRows, Iterable[str]]],
                        first: int) -> tuple[list[int], int, int]:
        """Insert `shards` (see add_sources) with ids from `first` on, skipping those indexed before; returns
        (their ids, rows inserted, rows meant to be)."""
        at = first
        ids: list[int] = []
        rows_of_shards, rows_of_blocks = [], []
        for run_id, shard, rows, _ in shards:
            if isinstance(rows, ShardRows):
                count = len(rows.shards)
                ids.append(range(at, at + count))
                rows_of_shards.extend(zip(range(at, at + count), repeat(run_id), rows.shards, rows.rows))
                at += count
                continue
            ids.append(at)
            if isinstance(rows, BlockRows):
                rows_of_blocks.append(
                    (at, run_id, shard, int(rows.first), len(rows.rows), _member_rows_blob(rows.rows)))
                at += rows.span
            else:
                rows_of_shards.append((at, run_id, shard, rows))
                at += 1
        inserted = self.db.executemany(
            "INSERT OR IGNORE INTO sources (source_id, run_id, shard, rows) VALUES (?, ?, ?, ?)", rows_of_shards,
        ).rowcount if rows_of_shards else 0
        inserted += self.db.executemany(
            "INSERT OR IGNORE INTO source_blocks (first_source, run_id, file, first_row, members, member_rows) "
            "VALUES (?, ?, ?, ?, ?, ?)", rows_of_blocks,
        ).rowcount if rows_of_blocks else 0
        return ids, inserted, len(rows_of_shards) + len(rows_of_blocks)

    def _next_source(self) -> int:
        (shards,) = self.db.execute("SELECT COALESCE(MAX(source_id), 0) FROM sources").fetchone()
        (blocks,) = self.db.execute("SELECT COALESCE(MAX(first_source + members - 1), 0) FROM source_blocks").fetchone()
        return max(shards, blocks) + 1

    def add_sources(self, shards: Sequence[tuple[str, str, int | BlockRows | ShardRows, Iterable[str]]]) -> list[Any]:
        """Index many committed shards, each (run_id, shard, rows, group_ids), in ONE transaction; their source ids in order.

        An entry whose rows are `BlockRows` indexes a block of members of the compacted file named `shard`; its id
        is the block's first (member i is that + i). One whose rows are `ShardRows` indexes its shards (`shard`
        unused); its id is theirs, in order: a `range` where they are consecutive (none indexed before), else a
        list. All or nothing: a failed transaction indexes none of them,
        and the next scan retries them all. Idempotent like `add_source` (a shard or block indexed before keeps
        its ids), and source ids follow the order given, so arrival order is the scan's order. One transaction
        per scan keeps a fresh start over many shards from paying one WAL commit per shard.
        """
        if not shards:
            return []
        with self._transaction():
            self.db.executemany(
                "INSERT OR IGNORE INTO ingested (group_id) VALUES (?)", [(g,) for _, _, _, ids in shards for g in ids]
            )
            first = self._next_source()
            self.db.execute("SAVEPOINT fresh")
            ids, inserted, wanted = self._insert_sources(shards, first)
            if inserted == wanted:  # none was indexed before (one statement per table, not one query per shard)
                self.db.execute("RELEASE fresh")
                return ids
            # Some were indexed before: they keep their ids, and the others take the next ones, one by one.
            self.db.execute("ROLLBACK TO fresh")
            self.db.execute("RELEASE fresh")
            ids = []
            at = first
            for entry in shards:
                run_id, shard, rows, _ = entry
                if isinstance(rows, ShardRows):  # shard by shard, as entries of their own
                    own: list[int] = []
                    for name, count in zip(rows.shards, rows.rows):
                        found = self.db.execute(
                            "SELECT source_id FROM sources WHERE run_id = ? AND shard = ?", (run_id, name)).fetchone()
                        if found is not None:
                            own.append(int(found[0]))
                            continue
                        self._insert_sources([(run_id, name, count, ())], at)
                        own.append(at)
                        at += 1
                    ids.append(own)
                    continue
                if isinstance(rows, BlockRows):
                    found = self.db.execute(
                        "SELECT first_source FROM source_blocks WHERE run_id = ? AND file = ? AND first_row = ?",
                        (run_id, shard, int(rows.first))).fetchone()
                else:
                    found = self.db.execute(
                        "SELECT source_id FROM sources WHERE run_id = ? AND shard = ?", (run_id, shard)).fetchone()
                if found is not None:
                    ids.append(int(found[0]))
                    continue
                self._insert_sources([entry], at)
                ids.append(at)
                at += rows.span if isinstance(rows, BlockRows) else 1
        return ids

    # ---- posted group ids (a client retrying after a crash must not add a group twice) ----
    def known_group_ids(self, group_ids: list[str]) -> set[str]:
        known: set[str] = set()
        for start in range(0, len(group_ids), 500):
            part = group_ids[start : start + 500]
            query = f"SELECT group_id FROM ingested WHERE group_id IN ({','.join('?' * len(part))})"
            known.update(row[0] for row in self.db.execute(query, part))
        return known

    def add_group_ids(self, group_ids: Iterable[str]) -> None:
        with self._transaction():
            self.db.executemany("INSERT OR IGNORE INTO ingested (group_id) VALUES (?)", [(g,) for g in group_ids])

    # ---- taken groups ----
    @property
    def epoch(self) -> int:
        """Training epoch: /reset_data starts a new one, so step numbers of an old run never mix with a new one."""
        return int(self.get("epoch", 0))

    def record_taken(self, keys: Iterable[tuple[int, int]], step: int, *, kv: dict[str, Any] | None = None) -> None:
        """Mark groups (source, row) as taken at `step` (>= 0 served, < 0 skipped), with kv updates, atomically."""
        epoch = self.epoch
        with self._transaction():
            self.db.executemany(
                "INSERT OR REPLACE INTO taken (source, row, step, pos, epoch) VALUES (?, ?, ?, ?, ?)",
                [(source, row, step, pos, epoch) for pos, (source, row) in enumerate(keys)],
            )
            if kv:
                self.db.executemany(
                    "INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    [(key, json.dumps(value)) for key, value in kv.items()],
                )

    def untaken_rows(self) -> int:
        """Rows of indexed shards and blocks that are not taken (served, skipped or discarded): what a start would
        queue. Counts only (taken rows are always rows of indexed sources: their ids outlive a fold)."""
        from array import array

        (shard_rows,) = self.db.execute("SELECT COALESCE(SUM(rows), 0) FROM sources").fetchone()
        block_rows = 0
        for (blob,) in self.db.execute("SELECT member_rows FROM source_blocks"):
            rows = array("q", blob)  # stored little-endian (`_member_rows_blob`)
            if sys.byteorder == "big":
                rows.byteswap()
            block_rows += sum(rows)
        (taken,) = self.db.execute("SELECT COUNT(*) FROM taken").fetchone()
        return int(shard_rows) + int(block_rows) - int(taken)

    def taken_rows(self) -> TakenRows:
        """Every taken (source, row), as arrays in key order (see `TakenRows`)."""
        import numpy as np

        flat = np.fromiter(chain.from_iterable(self.db.execute("SELECT source, row FROM taken ORDER BY source, row")),
                           dtype=np.int64)
        return TakenRows(flat[0::2], flat[1::2])

    def batches_from(self, step: int) -> list[tuple[int, list[tuple[int, int]]]]:
        """Served batches with step >= `step`: (step, [(source, row), ...]) in step order."""
        batches: dict[int, list[tuple[int, int]]] = {}
        for batch_step, source, row in self.db.execute(
            "SELECT step, source, row FROM taken WHERE epoch = ? AND step >= ? ORDER BY step, pos", (self.epoch, step)
        ):
            batches.setdefault(batch_step, []).append((source, row))
        return sorted(batches.items())

    def count_taken(self, step: int) -> int:
        """Groups taken with `step` in the current epoch (e.g. SKIPPED_STALE)."""
        (count,) = self.db.execute("SELECT COUNT(*) FROM taken WHERE epoch = ? AND step = ?", (self.epoch, step)).fetchone()
        return int(count)

    def served_groups(self) -> int:
        """Groups served in batches in the current epoch."""
        (count,) = self.db.execute("SELECT COUNT(*) FROM taken WHERE epoch = ? AND step >= 0", (self.epoch,)).fetchone()
        return int(count)

    def reset(self) -> None:
        """Forget registration, envs and step (what /reset_data clears) and start a new epoch; taken groups stay taken."""
        epoch = self.epoch + 1
        with self._transaction():
            self.db.execute("DELETE FROM envs")
            self.db.execute("DELETE FROM kv")
            self.db.execute("INSERT INTO kv (key, value) VALUES ('epoch', ?)", (json.dumps(epoch),))
