"""An export from a compacted store whose manifest holds each merged file's members as one block (issue 34): the
store source lists live files block by block, so its first group makes no record per member of the run's
history, and it exports exactly the groups, in the same order, that a store reading the commit log alone does."""

from __future__ import annotations

from factory.export.config import SourceConfig
from factory.export.source import iter_store_groups
from factory.store import MANIFEST_NAME, CommitRecord, ShardStore
from factory.store_compact import checkpoint, compact_run
from factory.store_records import Block
from factory.synthetic import synthetic_groups


def _store(root):
    """40 shards of 10 groups compacted into a few merged files and checkpointed, 2 shards committed after."""
    from bench.shards.scale import RUN, build_store

    build_store(root, 40)
    store = ShardStore(root)
    report = compact_run(store, RUN, target_bytes=500_000, row_group_groups=30, method="pages")
    assert len(report.files) > 1
    checkpoint(store, RUN)
    for chunk in range(2):
        groups = synthetic_groups(10, start=10**6 + chunk * 10, group_size=4, seq_len=64, env="bench")
        store.commit(RUN, "w1", chunk, groups)
    return RUN


def _groups(root, run, **kwargs):
    return [(g.group_id, g.item_key, g.scores, g.seq_lens) for g in
            iter_store_groups(SourceConfig(store=str(root), runs=[run], batch_groups=7), **kwargs)]


def test_first_group_of_an_export_makes_no_member_record(tmp_path, monkeypatch):
    run = _store(tmp_path)
    assert ShardStore(tmp_path)._read_log(run).records.has_blocks
    made = []
    records, record = Block.records, Block.record
    monkeypatch.setattr(Block, "records", lambda self: made.extend(records(self)) or records(self))
    monkeypatch.setattr(Block, "record", lambda self, i: made.append(i) or record(self, i))
    groups = iter_store_groups(SourceConfig(store=str(tmp_path), runs=[run]), need_tokens=False)
    first = next(groups)
    assert first.group_id and made == []
    assert sum(1 for _ in groups) == 419 and made == []


def test_an_export_from_blocks_equals_one_from_the_log(tmp_path):
    run = _store(tmp_path)
    from_blocks = _groups(tmp_path, run)
    manifest = tmp_path / run / MANIFEST_NAME
    manifest.rename(tmp_path / "aside")
    from_log = _groups(tmp_path, run)
    manifest.unlink(missing_ok=True)  # (re)written by the reader of the log
    (tmp_path / "aside").rename(manifest)
    assert len(from_blocks) == 420 and from_blocks == from_log
    assert _groups(tmp_path, run, need_tokens=False) == [(g, k, s, [0] * len(l)) for g, k, s, l in from_log]
    assert isinstance(ShardStore(tmp_path).record(run, "w0-00000003.parquet"), CommitRecord)
