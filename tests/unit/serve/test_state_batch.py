"""`ServedState.add_sources`: a scan's shards indexed in one transaction, all or nothing, idempotent, in order."""

import sqlite3

import pytest

from factory.serve.state import ServedState


def test_add_sources_keeps_order_and_ids_across_a_repeat(tmp_path):
    state = ServedState(tmp_path / "state.db")
    first = state.add_sources([("run", "a", 10, ["g1", "g2"]), ("run", "b", 5, [])])
    assert first == [1, 2]
    # A shard indexed before (e.g. by a transaction whose success was not reported) keeps its id.
    again = state.add_sources([("run", "b", 5, []), ("run", "c", 3, ["g3"])])
    assert again == [2, 3]
    assert state.sources() == [(1, "run", "a", 10), (2, "run", "b", 5), (3, "run", "c", 3)]
    assert state.known_group_ids(["g1", "g2", "g3", "g4"]) == {"g1", "g2", "g3"}
    assert state.add_sources([]) == []
    state.close()


def test_a_failed_batch_indexes_nothing(tmp_path):
    state = ServedState(tmp_path / "state.db")
    # The second shard's insert fails as a full disk would, after the first one's rows were written.
    state.db.execute("CREATE TEMP TRIGGER fail BEFORE INSERT ON sources WHEN NEW.shard = 'bad' BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    with pytest.raises(sqlite3.Error):
        state.add_sources([("run", "a", 10, ["g1"]), ("run", "bad", 5, [])])
    assert state.sources() == []
    assert state.known_group_ids(["g1"]) == set()
    assert state.add_sources([("run", "a", 10, ["g1"])]) == [1]
    state.close()


def test_add_sources_ids_when_some_were_indexed_before_and_after_other_runs(tmp_path):
    """The one-query path (every shard new: ids after the last one) and the per-shard path (some indexed before)
    give the ids a per-shard lookup gives."""
    state = ServedState(tmp_path / "s.db")
    assert state.add_sources([("r1", f"s{i}", 1, []) for i in range(3)]) == [1, 2, 3]
    assert state.add_sources([("r2", "s0", 1, []), ("r2", "s1", 1, [])]) == [4, 5]
    assert state.add_sources([("r1", "s9", 1, []), ("r1", "s1", 1, []), ("r2", "s2", 1, [])]) == [6, 2, 7]
    lookup = {(run, shard): source for source, run, shard, _ in state.sources()}
    assert lookup[("r1", "s9")] == 6 and lookup[("r2", "s2")] == 7
