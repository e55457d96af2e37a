"""The viewer's index of a run not compacted whose manifest holds its shards as a `Loose` run of columns (issue 34,
before compaction): a new index keeps the run pending as it is and makes a shard's record only when it indexes that
shard, newest first; once everything is indexed it holds what an index made from the commit log alone holds."""

from __future__ import annotations

import numpy as np
import pytest

import factory.store as store_module
from factory.store import MANIFEST_NAME, ShardStore
from factory.store_records import Loose
from factory.synthetic import synthetic_groups
from factory.viewer.index import RunIndex, StoreIndex

FRAME = ["row", "group_id", "item_key", "score_mean", "length_mean", "policy_version"]
COLUMNS = ("env", "family", "difficulty", "policy_version", "score_mean", "created_s", "group_size", "scores", "lengths")


@pytest.fixture
def made(monkeypatch):
    monkeypatch.setattr(store_module, "LOOSE_MIN", 4)
    counts = {"records": 0}
    records = Loose.records

    def counted(self):
        made = records(self)
        counts["records"] += len(made)
        return made

    monkeypatch.setattr(Loose, "records", counted)
    return counts


def _build(root, shards=12):
    from bench.shards.scale import RUN, build_store

    build_store(root, shards)  # every shard its own file, the manifest checkpointed
    ShardStore(root).commit(RUN, "w1", 0, synthetic_groups(10, start=10**6, group_size=4, seq_len=64, env="bench"))
    return RUN


def _from_log(root, run):
    aside = root / "manifest.aside"
    (root / run / MANIFEST_NAME).rename(aside)
    try:
        index = RunIndex(ShardStore(root), run)
        index.refresh()
    finally:
        aside.rename(root / run / MANIFEST_NAME)
    return index


def test_a_loose_run_is_indexed_newest_first_and_equals_the_record_by_record_index(tmp_path, made):
    run = _build(tmp_path)
    assert [type(item) for item in ShardStore(tmp_path).changed_items(run)[1]] == [Loose, store_module.CommitRecord]
    reference = _from_log(tmp_path, run)
    made["records"] = 0
    index = RunIndex(ShardStore(tmp_path), run)
    index.refresh(budget_s=0.0)  # the shard committed after the manifest
    assert made["records"] == 0 and index.pending == 12
    index.refresh(budget_s=0.0)  # the newest of the run: one record made
    assert made["records"] == 1 and index.pending == 11 and isinstance(index._pending[next(iter(index._pending))], Loose)
    assert index.frame["group_id"].to_list() == reference.frame["group_id"].to_list()[-20:]
    while index.pending:
        index.refresh(budget_s=0.0)
    assert made["records"] == 12
    assert index.frame.select(FRAME).to_dicts() == reference.frame.select(FRAME).to_dicts()
    for name in COLUMNS:
        np.testing.assert_array_equal(getattr(index.columns, name), getattr(reference.columns, name), err_msg=name)
    assert set(index.shards) == set(reference.shards) and not index.problems
    assert all(entry.record == reference.shards[name].record for name, entry in index.shards.items())
    assert not [key for key in index._order if key.startswith("\x00")]
    assert StoreIndex(ShardStore(tmp_path)).commit_counts(run) == (130, 13)

    # a shard of the run replaced: the store turns the run into records (a new generation): the index starts over
    store = ShardStore(tmp_path)
    store.commit(run, "w0", 3, synthetic_groups(10, start=3 * 10**6, group_size=4, seq_len=64, env="bench"), replace=True)
    index.refresh()
    fresh = _from_log(tmp_path, run)
    assert index.pending == 0 and index.frame.select(FRAME[1:]).to_dicts() == fresh.frame.select(FRAME[1:]).to_dicts()
