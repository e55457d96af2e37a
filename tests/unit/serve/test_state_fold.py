"""The served state's shards indexed one by one, read as columns (what a restart after a compaction folds), and
`fold_sources` by either of its two ways of dropping the folded rows."""

import numpy as np
import pytest

from factory.serve.state import ServedState


def _state(tmp_path, shards):
    state = ServedState(tmp_path / "state.db")
    state.add_sources([(run_id, shard, rows, []) for run_id, shard, rows in shards])
    return state


def _as_tuples(columns):
    return list(zip(columns.ids.tolist(), [columns.runs[code] for code in columns.run_codes.tolist()],
                    columns.shards.to_pylist(), columns.rows.tolist()))


@pytest.mark.parametrize("runs", [("gen",), ("gen", "other", "gen-2")])
def test_source_columns_are_the_sources_in_id_order(tmp_path, runs):
    state = _state(tmp_path, [(runs[i % len(runs)], f"w{i % 3}-{i:08d}.parquet", 10 + i, ) for i in range(50)])
    state.fold_sources([(11, runs[10 % len(runs)], "compact-a.parquet", 0, np.array([21, 22]))])  # ids 11, 12 gone
    columns = state.source_columns()
    assert _as_tuples(columns) == state.sources() and len(state.sources()) == 48
    assert sorted(columns.runs) == sorted(runs) and columns.ids.dtype == columns.rows.dtype == np.int64
    state.close()


def test_no_sources_are_empty_columns_and_a_name_with_a_line_break_is_no_columns(tmp_path):
    state = ServedState(tmp_path / "state.db")
    empty = state.source_columns()
    assert len(empty.ids) == len(empty.shards) == 0 and not state.has_sources()
    state.add_sources([("gen", "a.parquet", 1, []), ("gen", "odd\nname.parquet", 2, [])])
    assert state.has_sources() and state.source_columns() is None
    state.close()


@pytest.mark.parametrize("kept_known", [False, True])
def test_folding_keeps_the_sources_no_block_stands_for(tmp_path, kept_known):
    """Either way (the rows of each block deleted, or the table emptied and the kept rows put back) the same
    sources and blocks are left."""
    state = _state(tmp_path, [("gen", f"w0-{i:08d}.parquet", 10, ) for i in range(1, 21)])
    blocks = [(1, "gen", "compact-a.parquet", 0, np.full(8, 10)), (12, "gen", "compact-b.parquet", 0, np.full(6, 10))]
    kept = [9, 10, 11, 18, 19, 20]
    state.fold_sources(blocks, kept=kept if kept_known else None)
    assert [source[0] for source in state.sources()] == kept
    assert state.sources()[0] == (9, "gen", "w0-00000009.parquet", 10)
    assert [(b[0], b[2], b[4].tolist()) for b in state.source_blocks()] == [
        (1, "compact-a.parquet", [10] * 8), (12, "compact-b.parquet", [10] * 6)]
    assert state.add_source("gen", "w0-00000021.parquet", 10) == 21  # ids go on after the last one
    state.close()
