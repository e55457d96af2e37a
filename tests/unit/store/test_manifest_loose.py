"""A manifest's records of shards not compacted (each in its own file) are kept as `Loose` runs of columns when a
store object loads it (issue 34, before compaction): no record per shard until one is asked for, and every reader
API answers exactly what it answers from the commit log alone, through a change to a member, new commits and a
compaction applied on top."""

from __future__ import annotations

from pathlib import Path

import pytest

import factory.store as store_module
from factory.store import ShardStore, save_manifest
from factory.store_compact import checkpoint, compact_run
from factory.store_records import Block, Loose
from factory.synthetic import synthetic_groups
from tests.unit.store.test_manifest_blocks import _from_log, locate_agrees_with_where


@pytest.fixture(autouse=True)
def _short_runs(monkeypatch):
    monkeypatch.setattr(store_module, "LOOSE_MIN", 4)  # runs this short become a Loose here (64 in the store)


def _commit(store: ShardStore, producer: str, chunk: int, *, start: int | None = None, replace: bool = False) -> None:
    start = chunk * 10 + (producer == "w1") * 5000 if start is None else start
    store.commit("gen", producer, chunk, synthetic_groups(3, start=start, group_size=2, seq_len=8), replace=replace)


def _store(root: Path, chunks: int = 20, producers: tuple[str, ...] = ("w0", "w1")) -> ShardStore:
    store = ShardStore(root)
    for chunk in range(chunks):
        for producer in producers:
            _commit(store, producer, chunk)
    return store


def _same_answers(store: ShardStore, reference: ShardStore) -> None:
    log, want_log = store._read_log("gen"), reference._read_log("gen")
    assert log.live() == want_log.live() and list(log.iter_live()) == want_log.live()
    want = reference.committed("gen")
    locate_agrees_with_where(store, list(want))
    assert list(store.committed("gen").items()) == list(want.items())
    changes, want_changes = store.changes("gen")[1], reference.changes("gen")[1]
    assert changes == want_changes and [r.index for r in changes] == [r.index for r in want_changes]
    for name, record in want.items():
        assert store.record("gen", name) == record and store.record("gen", name).index == record.index
        assert store.where("gen", name) == (record.physical, record.row_offset)
        own = log.records.own(name)
        assert own == record if not record.file else own in (None, record)  # None: a member of a compacted block
    assert store.record("gen", "w0-99999999.parquet") is None and store.where("gen", "nope.parquet") is None
    assert len(log.records) == len(want) and log.rows == store.count("gen") == reference.count("gen")
    assert [g.group_id for g in store.iter_groups("gen")] == [g.group_id for g in reference.iter_groups("gen")]
    assert store.verify("gen") == []


def _loose(store: ShardStore) -> list[Loose]:
    return [item for item in store._read_log("gen").records.items_in_order() if type(item) is Loose]


def test_loose_records_load_as_columns_and_answer_as_the_log(tmp_path):
    _store(tmp_path)
    checkpoint(ShardStore(tmp_path), "gen")
    fresh = ShardStore(tmp_path)
    log = fresh._read_log("gen")
    assert [len(item) for item in _loose(fresh)] == [40] and len(log.changed) == 1 and len(log.records) == 40
    assert all(r.index is not None for r in fresh.changes("gen")[1])  # the commit lines' summaries, kept
    first = next(iter(log.iter_live()))
    assert first[0] == "w0-00000000.parquet" and log.records._index is None  # no index, no record per member
    _same_answers(fresh, _from_log(tmp_path))
    assert _loose(fresh)  # reading every answer kept the columns


def test_a_change_to_one_member_turns_the_run_into_records(tmp_path):
    _store(tmp_path)
    checkpoint(ShardStore(tmp_path), "gen")
    fresh = ShardStore(tmp_path)
    cursor, items = fresh.changed_items("gen")
    assert [type(item) for item in items] == [Loose]
    _commit(fresh, "w1", 3, start=90_000, replace=True)
    assert not _loose(fresh)
    again, records = fresh.changes("gen", cursor)  # a new generation: every record again, the replaced one last
    assert len(records) == 40 and records[-1].shard == "w1-00000003.parquet"
    _same_answers(fresh, _from_log(tmp_path))
    checkpoint(fresh, "gen")  # saved from records: loose again when loaded
    assert [len(item) for item in _loose(ShardStore(tmp_path))] == [40]
    _same_answers(ShardStore(tmp_path), _from_log(tmp_path))


def test_new_commits_keep_the_run_and_save_it_back(tmp_path):
    _store(tmp_path)
    checkpoint(ShardStore(tmp_path), "gen")
    fresh = ShardStore(tmp_path)
    cursor, _ = fresh.changed_items("gen")
    for chunk in range(20, 23):
        _commit(fresh, "w0", chunk)
    records = fresh._read_log("gen").records
    assert all(item.regular for item in _loose(fresh))  # the manifest said so: its chunk ranges from its columns
    assert _loose(fresh) and records._index is None  # new chunks: outside the run's chunk ranges
    assert records._ranges == {"w0": (0, 19), "w1": (0, 19)} and not records._irregular
    assert fresh.is_committed("gen", "w1", 7) and not fresh.is_committed("gen", "w1", 30) and _loose(fresh)
    _, items = fresh.changed_items("gen", cursor)
    assert [r.shard for r in items] == [f"w0-{c:08d}.parquet" for c in range(20, 23)]
    _same_answers(fresh, _from_log(tmp_path))
    assert save_manifest(fresh.manifest_path("gen"), fresh._read_log("gen"))  # a Loose written back from columns
    again = ShardStore(tmp_path)
    assert [len(item) for item in _loose(again)] == [43]
    _same_answers(again, _from_log(tmp_path))


def test_a_compaction_on_top_of_loose_records(tmp_path):
    _store(tmp_path)
    checkpoint(ShardStore(tmp_path), "gen")
    # compacted by another store object, its records left in the log after the manifest (fewer than a checkpoint's)
    report = compact_run(ShardStore(tmp_path), "gen", target_bytes=30_000)
    assert report.shards >= 30 and len(report.files) > 1
    fresh = ShardStore(tmp_path)  # the manifest's Loose run, then the compaction records applied to its members
    assert not _loose(fresh) and fresh.compacted("gen")
    _same_answers(fresh, _from_log(tmp_path))
    # and the compactor's own store object, which held the run as columns when it compacted
    other = tmp_path / "other"
    _store(other)
    checkpoint(ShardStore(other), "gen")
    compactor = ShardStore(other)
    assert _loose(compactor)
    compact_run(compactor, "gen", target_bytes=30_000)
    _same_answers(compactor, _from_log(other))


def test_blocks_and_loose_runs_together(tmp_path):
    store = _store(tmp_path, 10)
    compact_run(store, "gen", target_bytes=30_000)
    for chunk in range(10, 20):
        _commit(store, "w0", chunk)
    _commit(store, "w1", 2, start=70_000, replace=True)  # a member of a merged file replaced: a record after
    for chunk in range(20, 25):
        _commit(store, "w0", chunk)
    checkpoint(store, "gen")
    fresh = ShardStore(tmp_path)
    kinds = [type(item) for item in fresh._read_log("gen").records.items_in_order()]
    assert Block in kinds and kinds.count(Loose) == 1 and [len(item) for item in _loose(fresh)] == [16]
    _same_answers(fresh, _from_log(tmp_path))
    assert "w1-00000002.parquet" in fresh._read_log("gen").records and "w9-00000002.parquet" not in fresh._read_log("gen").records


def test_run_api_scans_and_locates_loose_members_as_records(tmp_path):
    from factory.serve.follower import Locator, scan_new_shards

    _store(tmp_path)
    checkpoint(ShardStore(tmp_path), "gen")
    fresh, reference = ShardStore(tmp_path), _from_log(tmp_path)
    assert _loose(fresh)
    want = scan_new_shards(reference, ["gen"], set(), set())
    got = scan_new_shards(fresh, ["gen"], set(), set())
    assert [(s.shard, s.rows, s.path) for s in got] == [(s.shard, s.rows, s.path) for s in want] and len(got) == 40
    known = {("gen", s.shard) for s in want[::2]}  # half known: only the others come, in order
    got = scan_new_shards(ShardStore(tmp_path), ["gen"], known, set())
    assert [s.shard for s in got] == [s.shard for s in want[1::2]]
    locator, old = Locator(fresh), Locator(reference)
    for shard in want:
        own = locator.own_file("gen", shard.shard, shard.rows)
        assert own is not None and own == old.own_file("gen", shard.shard, shard.rows)
        assert locator.locate("gen", shard.shard) == old.locate("gen", shard.shard)
    assert _loose(fresh)


def test_chunk_ranges_of_a_loose_run_from_its_columns_or_its_names():
    import pyarrow as pa

    from factory.store_records import MEMBER_FIELDS, Loose, chunk_ranges

    def loose(names, producers, chunks):
        count = len(names)
        columns = {"shard": names, "run_id": ["r"] * count, "producer": producers, "chunk": chunks, "rows": [1] * count,
                   "bytes": [1] * count, "sha256": ["x"] * count, "committed_at": ["t"] * count}
        return Loose(pa.table({name: columns[name] for name in MEMBER_FIELDS}), None, [None], [None])

    names = ["w0-00000003.parquet", "w1-00000001.parquet", "w0-123456789.parquet"]
    assert loose(names, ["w0", "w1", "w0"], [3, 1, 123456789]).chunk_ranges() == {"w0": (3, 123456789), "w1": (1, 1)}
    odd = ["w0-00000003.parquet", "other.parquet"]  # a name not made from its producer and chunk: by its name
    assert loose(odd, ["w0", "w0"], [3, 4]).chunk_ranges() is None is chunk_ranges(pa.chunked_array([odd]))
    renamed = ["w0-00000003.parquet", "w2-00000009.parquet"]
    assert loose(renamed, ["w0", "w0"], [3, 4]).chunk_ranges() == {"w0": (3, 3), "w2": (9, 9)}


def test_a_manifest_with_an_odd_record_name_does_not_claim_regular_names(tmp_path):
    from factory.store import _manifest_table

    _store(tmp_path, 5)
    store = ShardStore(tmp_path)
    log = store._read_log("gen")
    assert _manifest_table(log)[2] is True
    odd = log.records["w0-00000002.parquet"].__dict__
    odd["shard"] = "odd.parquet"  # (a hand-edited log's record, say)
    assert _manifest_table(log)[2] is False
