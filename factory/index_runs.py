"""The index columns of a file as runs of equal rows: written by compaction into a merged file's record, and by every
commit into its shard's record.

run-api queues a group by its env (lane), group size and policy version; at a start-up it reads these columns of
every file (about 1.4 s per million groups decoded from Parquet). A compacted file's rows mostly come in long runs
(one env and policy version per chunk, one group size per env), so the compaction records them as runs, and a
start-up makes the columns from the runs (numpy repeats) instead of reading the file. A file whose rows change too
often to be worth it gets no summary and is read as before.

A shard's commit record carries the same summary (`summarize_rows`, at most `SHARD_MAX_RUNS` runs: one env and one
policy version per chunk is one run, a few dozen bytes on the line), so that a start-up before compaction does not
open every shard either: `table_of_many` makes the columns of many shards' summaries at once. A summary is data
of the same checksummed line as the record's rows and sha256, written by the writer from the rows it wrote; a
reader still takes it only where it is well formed and its runs add up to the record's rows (`valid`), and reads
the file otherwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from factory.schema import GROUP_SCHEMA
from factory.store_records import column, int64_values

INDEX_COLUMNS = ["env", "env_id", "policy_version", "group_size"]
_INDEX_SCHEMA = pa.schema([GROUP_SCHEMA.field(name) for name in INDEX_COLUMNS])
SUMMARY_SCHEMA = pa.schema([pa.field("env", pa.dictionary(pa.int32(), pa.string()), nullable=False)]
                           + [GROUP_SCHEMA.field(name) for name in INDEX_COLUMNS[1:]])
"""Index columns as `table_of` makes them: env as codes into the runs' names."""
MAX_RUNS = 4096
"""A summary of more runs than this (or than a tenth of the file's rows) is not written."""
SHARD_MAX_RUNS = 64
"""A shard's commit record carries a summary of at most this many runs (opening the shard costs ~0.8 ms; a run on
the line ~20 bytes)."""


def summarize(index: pa.Table) -> dict[str, Any] | None:
    """Runs of equal index rows: {"env": [names], "runs": [[env, env_id or None, policy_version, group_size,
    rows], ...]} (env as a position in "env"), or None where there are too many runs."""
    import pyarrow.compute as pc

    rows = index.num_rows
    encoded = pc.dictionary_encode(index.column("env")).combine_chunks()
    null = np.iinfo(np.int64).min
    envs = int64_values(encoded.indices)
    env_ids = int64_values(index.column("env_id"), null)
    versions = int64_values(index.column("policy_version"))
    sizes = int64_values(index.column("group_size"))
    if not rows:
        return {"env": [], "runs": []}
    change = np.zeros(rows, dtype=bool)
    change[0] = True
    for values in (envs, env_ids, versions, sizes):
        change[1:] |= values[1:] != values[:-1]
    starts = np.flatnonzero(change)
    if len(starts) > min(MAX_RUNS, max(1, rows // 10)):
        return None
    counts = np.diff(np.append(starts, rows))
    runs = [[int(e), None if i == null else int(i), int(v), int(s), int(c)]
            for e, i, v, s, c in zip(envs[starts], env_ids[starts], versions[starts], sizes[starts], counts)]
    return {"env": encoded.dictionary.to_pylist(), "runs": runs}


def summarize_rows(envs: list[str], env_ids: list[int | None], versions: list[int], sizes: list[int],
                   max_runs: int = SHARD_MAX_RUNS) -> dict[str, Any] | None:
    """`summarize` of index columns given as Python lists (a commit's rows, without pyarrow.compute): the same
    shape, env names in order of first appearance; None where there are more than `max_runs` runs."""
    names: dict[str, int] = {}
    runs: list[list[Any]] = []
    last = None
    for row in zip(envs, env_ids, versions, sizes):
        if row == last:
            runs[-1][4] += 1
            continue
        if len(runs) >= max_runs:
            return None
        last = row
        env, env_id, version, size = row
        runs.append([names.setdefault(env, len(names)), None if env_id is None else int(env_id), int(version),
                     int(size), 1])
    return {"env": list(names), "runs": runs}


def summarize_table(rows: Any, max_runs: int = SHARD_MAX_RUNS) -> dict[str, Any] | None:
    """`summarize_rows` of an Arrow table or record batch holding INDEX_COLUMNS (a commit's few rows)."""
    return summarize_rows(*(rows.column(name).to_pylist() for name in INDEX_COLUMNS), max_runs=max_runs)


def valid(summary: Any, rows: int) -> bool:
    """A summary of the expected shape whose runs add up to `rows` (a record's rows): else it is not used."""
    return rows is not None and total_rows(summary) == rows


def total_rows(summary: Any) -> int | None:
    """The rows a summary stands for, or None if it is not of the expected shape."""
    try:
        names, runs = summary["env"], summary["runs"]
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            return None
        total = 0
        for env, env_id, version, size, count in runs:
            if not (type(env) is int and 0 <= env < len(names) and (env_id is None or type(env_id) is int)
                    and type(version) is int and type(size) is int and type(count) is int and count > 0):
                return None
            total += count
        return total
    except (TypeError, ValueError, KeyError):
        return None


def rows_of(summary: dict[str, Any]) -> int:
    return sum(run[4] for run in summary["runs"])


def _array(type_: pa.DataType, values: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    values = np.ascontiguousarray(values)
    if valid is None or valid.all():
        return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(values)])
    bits = np.packbits(valid, bitorder="little")
    return pa.Array.from_buffers(type_, len(values), [pa.py_buffer(bits), pa.py_buffer(values)], int((~valid).sum()))


def table_of(summary: dict[str, Any]) -> pa.Table:
    """The index columns the runs stand for, made without pyarrow's pandas-importing constructors: types as
    GROUP_SCHEMA's, but env dictionary-encoded (codes into the runs' names, `SUMMARY_SCHEMA`), as the runs hold it:
    run-api's queueing wants codes, not a string per group made only to be encoded again (~0.3 s over 10M
    groups). `plain` gives GROUP_SCHEMA's types."""
    runs = summary["runs"]
    counts = np.array([run[4] for run in runs], dtype=np.int64)
    envs = np.repeat(np.array([run[0] for run in runs], dtype=np.int32), counts)
    ids = np.repeat(np.array([0 if run[1] is None else run[1] for run in runs], dtype=np.int64), counts)
    valid = np.repeat(np.array([run[1] is not None for run in runs], dtype=bool), counts)
    versions = np.repeat(np.array([run[2] for run in runs], dtype=np.int64), counts)
    sizes = np.repeat(np.array([run[3] for run in runs], dtype=np.int32), counts)
    env = pa.DictionaryArray.from_arrays(_array(pa.int32(), envs), column(summary["env"], pa.string()))
    return pa.Table.from_arrays(
        [env, _array(pa.int64(), ids, valid), _array(pa.int64(), versions), _array(pa.int32(), sizes)],
        schema=SUMMARY_SCHEMA)


def table_of_many(summaries: list[dict[str, Any]]) -> pa.Table:
    """`table_of` of the summaries' rows one after the other (shards of a run, in commit order): one table, with
    numpy work per distinct summary object and per run, not per shard (shards of one producer mostly share one
    summary object: see `intern`)."""
    # distinct objects numbered in order of first appearance (as a dict would, but with numpy, not per shard)
    objects = np.fromiter(map(id, summaries), dtype=np.int64, count=len(summaries))
    _, firsts_at, inverse = np.unique(objects, return_index=True, return_inverse=True)
    order = np.argsort(firsts_at, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    kind = rank[inverse.reshape(-1)]
    uniques = [summaries[at] for at in firsts_at[order].tolist()]
    names: dict[str, int] = {}
    columns: list[list[int]] = [[], [], [], [], [], []]  # env, env_id, valid, version, size, count
    firsts, lengths = [], []
    for summary in uniques:
        codes = [names.setdefault(name, len(names)) for name in summary["env"]]
        firsts.append(len(columns[0]))
        lengths.append(len(summary["runs"]))
        for env, env_id, version, size, count in summary["runs"]:
            for kept, value in zip(columns, (codes[env], env_id or 0, env_id is not None, version, size, count)):
                kept.append(value)
    if all(length == 1 for length in lengths):  # one run per shard, the usual case
        runs = np.array(firsts, dtype=np.int64)[kind]
    else:
        per = np.array(lengths, dtype=np.int64)[kind]
        starts = np.repeat(np.array(firsts, dtype=np.int64)[kind], per)
        runs = starts + np.arange(int(per.sum()), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
    counts = np.array(columns[5], dtype=np.int64)[runs]

    def repeat(values: list[Any], dtype: Any) -> np.ndarray:
        return np.repeat(np.array(values, dtype=dtype)[runs], counts)

    valid_ids = repeat(columns[2], bool)
    env = pa.DictionaryArray.from_arrays(_array(pa.int32(), repeat(columns[0], np.int32)), column(list(names), pa.string()))
    return pa.Table.from_arrays(
        [env, _array(pa.int64(), repeat(columns[1], np.int64), valid_ids), _array(pa.int64(), repeat(columns[3], np.int64)),
         _array(pa.int32(), repeat(columns[4], np.int32))], schema=SUMMARY_SCHEMA)


_INTERNED: dict[Any, dict[str, Any]] = {}


def intern(summary: dict[str, Any]) -> dict[str, Any]:
    """One shared object per distinct summary (read-only from here on): a million shards' records hold a handful of
    summaries, not a million dicts, and `table_of_many` works per distinct object."""
    try:
        key = (tuple(summary["env"]), tuple(map(tuple, summary["runs"])))
    except (TypeError, KeyError):
        return summary
    found = _INTERNED.get(key)
    if found is None:
        if len(_INTERNED) >= 65_536:
            _INTERNED.clear()
        found = _INTERNED[key] = summary
    return found


def plain(index: pa.Table) -> pa.Table:
    """Index columns with GROUP_SCHEMA's types (a dictionary-encoded env of `table_of` as strings)."""
    return index if index.schema.field("env").type == pa.string() else index.cast(_INDEX_SCHEMA)
