"""The index columns of a merged file as runs of equal rows, written by compaction into its commit-log record.

run-api queues a group by its env (lane), group size and policy version; at a start-up it reads these columns of
every file (about 1.4 s per million groups decoded from Parquet). A compacted file's rows mostly come in long runs
(one env and policy version per chunk, one group size per env), so the compaction records them as runs, and a
start-up makes the columns from the runs (numpy repeats) instead of reading the file. A file whose rows change too
often to be worth it gets no summary and is read as before.
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


def plain(index: pa.Table) -> pa.Table:
    """Index columns with GROUP_SCHEMA's types (a dictionary-encoded env of `table_of` as strings)."""
    return index if index.schema.field("env").type == pa.string() else index.cast(_INDEX_SCHEMA)
