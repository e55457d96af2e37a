"""The viewer's index of a compacted run whose manifest holds each merged file's members as one block (issue 34):
a new index keeps the blocks pending as they are and makes a member's record only when it indexes that member, so
its first page costs the newest row groups, not a record per shard of the run's history; once everything is
indexed it holds exactly what an index made from the commit log alone (record by record) holds."""

from __future__ import annotations

import numpy as np
import pytest

from factory.store import MANIFEST_NAME, ShardStore
from factory.store_compact import checkpoint, compact_run
from factory.store_records import Block
from factory.synthetic import synthetic_groups
from factory.viewer.index import RunIndex, StoreIndex

COLUMNS = ("env", "family", "difficulty", "policy_version", "score_mean", "created_s", "group_size", "scores",
           "lengths", "first")
FRAME = ["row", "group_id", "item_key", "score_mean", "length_mean", "policy_version"]


def _build(root, shards=30, row_group_groups=40, target_bytes=None):
    """`shards` shards of 10 groups, compacted into row groups of 4 shards, checkpointed, plus 2 shards committed
    after the manifest (new chunks of another producer): a fresh store object holds blocks and 2 records."""
    from bench.shards.scale import RUN, build_store

    build_store(root, shards)
    store = ShardStore(root)
    kwargs = {"target_bytes": target_bytes} if target_bytes else {}
    report = compact_run(store, RUN, row_group_groups=row_group_groups, method="pages", **kwargs)
    checkpoint(store, RUN)
    for chunk in range(2):
        groups = synthetic_groups(10, start=10**6 + chunk * 10, group_size=4, seq_len=64, env="bench")
        store.commit(RUN, "w1", chunk, groups)
    fresh = ShardStore(root)
    assert fresh._read_log(RUN).records.has_blocks
    return RUN, report


def _from_log(root, run):
    """An index made from the commit log alone (the manifest moved aside): a record per shard, as before blocks."""
    manifest = root / run / MANIFEST_NAME
    aside = root / "manifest.aside"
    manifest.rename(aside)
    try:
        index = RunIndex(ShardStore(root), run)
        index.refresh()
        assert not index.store._read_log(run).records.has_blocks
    finally:
        aside.rename(manifest)
    return index


@pytest.fixture
def made(monkeypatch):
    """Counts the member records made from blocks (Block.records / Block.record)."""
    counts = {"records": 0}
    records, record = Block.records, Block.record

    def counted_records(self):
        made = records(self)
        counts["records"] += len(made)
        return made

    def counted_record(self, index):
        counts["records"] += 1
        return record(self, index)

    monkeypatch.setattr(Block, "records", counted_records)
    monkeypatch.setattr(Block, "record", counted_record)
    return counts


def test_first_page_makes_records_only_for_the_members_it_indexes(tmp_path, made):
    run, report = _build(tmp_path, shards=30)
    assert len(report.files) == 1
    index = RunIndex(ShardStore(tmp_path), run)
    index.refresh(budget_s=0.0)  # one step: the newest shard (a record committed after the manifest)
    assert made["records"] == 0 and index.pending == 31 and index.frame.height == 10
    index.refresh(budget_s=0.0)  # the other new shard, then the newest row group of the merged file
    index.refresh(budget_s=0.0)
    # 30 shards in row groups of 4: the last row group holds shards 28, 29; their records only (a record per
    # member of the run was made here before blocks: 30)
    assert made["records"] == 2 and index.pending == 28 and index.frame.height == 40
    assert isinstance(index._pending[next(reversed(index._pending))], Block)


def test_a_block_index_equals_the_index_made_record_by_record(tmp_path, made):
    run, _ = _build(tmp_path, shards=30)
    reference = _from_log(tmp_path, run)
    made["records"] = 0
    index = RunIndex(ShardStore(tmp_path), run)
    steps = 0
    while True:
        index.refresh(budget_s=0.0)
        steps += 1
        if not index.pending:
            break
    assert made["records"] == 30  # each member once, as it was indexed
    assert steps == 2 + 8  # the 2 new shards, then one step per row group (30 shards in row groups of 4)
    assert index.frame.select(FRAME).to_dicts() == reference.frame.select(FRAME).to_dicts()
    for name in COLUMNS:
        np.testing.assert_array_equal(getattr(index.columns, name), getattr(reference.columns, name), err_msg=name)
    assert set(index.shards) == set(reference.shards) and not index.problems
    for name, entry in index.shards.items():
        assert entry.record == reference.shards[name].record
        assert index._frames[name].select(FRAME).to_dicts() == reference._frames[name].select(FRAME).to_dicts()
    assert not [key for key in index._order if key.startswith("\x00")]  # no block left in the order
    rows = index.frame.slice(25, 30)
    assert index.read_rows(rows, ["group_id", "messages"]) == reference.read_rows(reference.frame.slice(25, 30),
                                                                                   ["group_id", "messages"])
    assert StoreIndex(ShardStore(tmp_path)).commit_counts(run) == (320, 32)

    # keeps up: a new shard, then a shard replaced (the store turns its blocks into records: a new cursor
    # generation, so the index starts over, record by record)
    store = ShardStore(tmp_path)
    store.commit(run, "w1", 2, synthetic_groups(10, start=2 * 10**6, group_size=4, seq_len=64, env="bench"))
    assert index.refresh() == 10 and index.pending == 0 and index.frame.height == 330
    replaced = synthetic_groups(10, start=3 * 10**6, group_size=4, seq_len=64, env="bench")
    store.commit(run, "w0", 3, replaced, replace=True)
    index.refresh()
    fresh = RunIndex(ShardStore(tmp_path), run)
    fresh.refresh()
    assert index.pending == 0 and index.frame.select(FRAME[1:]).to_dicts() == fresh.frame.select(FRAME[1:]).to_dicts()
    assert index.frame.height == 330


def test_blocks_of_several_files_and_budgets_keep_commit_order(tmp_path):
    run, report = _build(tmp_path, shards=40, row_group_groups=30, target_bytes=500_000)
    assert len(report.files) > 1
    reference = _from_log(tmp_path, run)
    index = RunIndex(ShardStore(tmp_path), run)
    seen = []
    while True:
        index.refresh(budget_s=0.0)
        seen.append(index.frame.height)
        # what is indexed is always the newest groups, in commit order
        assert index.frame["group_id"].to_list() == reference.frame["group_id"].to_list()[-index.frame.height:]
        assert index.pending == 42 - len(index.shards)
        if not index.pending:
            break
    assert seen == sorted(seen) and len(seen) < 42


def test_a_missing_merged_file_is_a_problem_and_its_block_is_dropped(tmp_path):
    run, report = _build(tmp_path, shards=12)
    (tmp_path / run / "shards" / report.files[0]).unlink()
    index = RunIndex(ShardStore(tmp_path), run)
    assert index.refresh() == 20
    assert index.pending == 0 and list(index.problems.values()) == ["missing"] and len(index.shards) == 2
