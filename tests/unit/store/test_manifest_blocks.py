"""A manifest that covers a compaction keeps each merged file's members as one block (columns, not a record each),
and every reader API answers exactly what it answers from the commit log alone."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from factory.store import _MANIFEST_SCHEMA, MANIFEST_NAME, ShardStore
from factory.store_compact import checkpoint, compact_run
from factory.store_records import Block, column
from factory.synthetic import synthetic_groups


def _store(root: Path, chunks: int = 30, *, producers: tuple[str, ...] = ("w0",)) -> ShardStore:
    store = ShardStore(root)
    for chunk in range(chunks):
        for number, producer in enumerate(producers):
            start = (chunk * len(producers) + number) * 3
            store.commit("gen", producer, chunk, synthetic_groups(3, start=start, group_size=2, seq_len=8))
    return store


def _from_log(root: Path) -> ShardStore:
    """A store object that reads the whole log (the manifest moved aside while it does)."""
    manifest = root / "gen" / MANIFEST_NAME
    aside = root / "manifest.aside"
    if manifest.exists():
        manifest.rename(aside)
    store = ShardStore(root)
    store._read_log("gen")
    if aside.exists():
        aside.rename(manifest)
    return store


def locate_agrees_with_where(store: ShardStore, names: list[str], others: bool = True) -> None:
    """`Records.locate` (every name at once, as columns) says what `where` says name by name: the merged file and
    first row, or -1 for a shard in its own file or not committed (`others`: names of neither kind added)."""
    names = names + (["nope.parquet", "w0-99999999.parquet", "w0-00000000.parquet"] if others else [])
    codes, files, firsts = store._read_log("gen").records.locate(column(names, pa.string()))
    for name, code, first in zip(names, codes.tolist(), firsts.tolist()):
        found = store._read_log("gen").records.where(name)
        assert (None if code < 0 else (files[code], first)) == (None if found is None or found[0] == name else found)


def _same_answers(store: ShardStore, reference: ShardStore) -> None:
    want = reference.committed("gen")
    locate_agrees_with_where(store, list(want))
    assert store.committed("gen") == want
    assert list(store.committed("gen")) == list(want)  # log order
    assert [r.shard for r in store.changes("gen")[1]] == [r.shard for r in reference.changes("gen")[1]]
    assert store.changes("gen")[1] == reference.changes("gen")[1]
    for name, record in want.items():
        assert store.record("gen", name) == record
        assert store.where("gen", name) == (record.physical, record.row_offset)
        assert name in store._read_log("gen").records
    assert store.record("gen", "w0-99999999.parquet") is None and store.where("gen", "nope.parquet") is None
    assert store._read_log("gen").live() == reference._read_log("gen").live()
    assert store.count("gen") == reference.count("gen") == sum(r.rows for r in want.values())
    assert [g.group_id for g in store.iter_groups("gen")] == [g.group_id for g in reference.iter_groups("gen")]
    assert store.verify("gen") == []


def test_a_manifest_after_compaction_holds_one_block_per_merged_file(tmp_path):
    store = _store(tmp_path, producers=("w0", "w1"))
    compact_run(store, "gen", target_bytes=60_000)
    store.commit("gen", "w0", 30, synthetic_groups(3, start=900, group_size=2, seq_len=8))
    checkpoint(store, "gen")
    fresh = ShardStore(tmp_path)
    log = fresh._read_log("gen")
    blocks = [item for item in log.records.items_in_order() if type(item) is Block]
    loose = [item for item in log.records.items_in_order() if type(item) is not Block]
    assert len(blocks) == len(log.files) > 1 and [r.shard for r in loose] == ["w0-00000030.parquet"]
    assert sum(len(b) for b in blocks) == 60 and len(log.records) == 61
    assert len(log.changed) == len(blocks) + 1  # a change entry per block, not per member
    cursor, items = fresh.changed_items("gen")
    assert [type(item) for item in items] == [Block] * len(blocks) + [type(loose[0])]
    _same_answers(fresh, _from_log(tmp_path))
    assert fresh._read_log("gen").records.has_blocks  # reading every answer did not turn blocks into records
    members = [name for block in blocks for name in block.names()]
    locate_agrees_with_where(fresh, members, others=False)  # all members in their order: one compare, no lookups
    locate_agrees_with_where(fresh, members[5:40], others=False)
    locate_agrees_with_where(fresh, members[::-1], others=False)


def test_new_commits_after_the_manifest_keep_the_blocks_and_build_no_member_index(tmp_path):
    store = _store(tmp_path)
    compact_run(store, "gen", target_bytes=1 << 30)
    checkpoint(store, "gen")
    fresh = ShardStore(tmp_path)
    cursor, _ = fresh.changed_items("gen")
    for chunk in range(30, 33):
        fresh.commit("gen", "w0", chunk, synthetic_groups(3, start=chunk * 3, group_size=2, seq_len=8))
    records = fresh._read_log("gen").records
    assert records.has_blocks and records._index is None
    cursor, items = fresh.changed_items("gen", cursor)
    assert [r.shard for r in items] == [f"w0-{c:08d}.parquet" for c in range(30, 33)]
    _same_answers(fresh, _from_log(tmp_path))


def test_re_committing_a_compacted_shard_turns_blocks_back_into_records(tmp_path):
    store = _store(tmp_path)
    compact_run(store, "gen", target_bytes=60_000)
    checkpoint(store, "gen")
    fresh = ShardStore(tmp_path)
    cursor, _ = fresh.changed_items("gen")
    fresh.commit("gen", "w0", 4, synthetic_groups(3, start=500, group_size=2, seq_len=8), replace=True)
    assert not fresh._read_log("gen").records.has_blocks
    again, records = fresh.changes("gen", cursor)
    assert len(records) == 30 and records[-1].shard == "w0-00000004.parquet" and not records[-1].file  # all again
    _same_answers(fresh, _from_log(tmp_path))
    checkpoint(fresh, "gen")  # saved again: the members still in their merged files are blocks again
    again = ShardStore(tmp_path)
    assert again._read_log("gen").records.has_blocks
    _same_answers(again, _from_log(tmp_path))


def test_compacting_again_merges_only_the_new_shards(tmp_path):
    store = _store(tmp_path)
    compact_run(store, "gen", target_bytes=1 << 30)
    checkpoint(store, "gen")
    fresh = ShardStore(tmp_path)
    for chunk in range(30, 40):
        fresh.commit("gen", "w0", chunk, synthetic_groups(3, start=chunk * 3, group_size=2, seq_len=8))
    report = compact_run(fresh, "gen", target_bytes=1 << 30)
    assert report.shards == 10 and len(report.files) == 1
    checkpoint(fresh, "gen")
    last = ShardStore(tmp_path)
    assert sum(type(item) is Block for item in last._read_log("gen").records.items_in_order()) == 2
    _same_answers(last, _from_log(tmp_path))


def test_names_that_do_not_follow_shard_names_are_still_found(tmp_path):
    store = _store(tmp_path, 6)
    compact_run(store, "gen", target_bytes=1 << 30)
    checkpoint(store, "gen")
    records = ShardStore(tmp_path)._read_log("gen").records
    assert "w1-00000003.parquet" not in records and "w0-00000009.parquet" not in records
    assert "compact-w0-00000000-0123abcd.parquet" not in records
    assert records._index is None  # outside every producer's chunks: no index of the members was needed
    assert "w0-00000003.parquet" in records and "w0-0000003.parquet" not in records
    assert records.get("w0-00000005.parquet").row_offset == 15


def test_a_version_1_manifest_is_still_read(tmp_path):
    store = _store(tmp_path, 6)
    compact_run(store, "gen", target_bytes=1 << 30)
    log = store._read_log("gen")
    records = list(log.records.values())
    table = pa.Table.from_pydict({name: [getattr(r, name) for r in records] for name in _MANIFEST_SCHEMA.names},
                                 schema=_MANIFEST_SCHEMA)
    meta = {"version": 1, "offset": log.offset, "lines": log.lines, "tail": log.tail.hex(), "files": log.files, "bad": log.bad}
    table = table.replace_schema_metadata({"manifest": json.dumps(meta)})
    with pa.OSFile(str(store.manifest_path("gen")), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    fresh = ShardStore(tmp_path)
    assert fresh._read_log("gen").lines == log.lines and not fresh._read_log("gen").records.has_blocks
    _same_answers(fresh, _from_log(tmp_path))


@pytest.mark.parametrize("shards", [0, 1])
def test_small_runs_save_and_load(tmp_path, shards):
    store = _store(tmp_path, shards)
    if shards:
        checkpoint(store, "gen")
    _same_answers(ShardStore(tmp_path), _from_log(tmp_path))


def test_the_manifest_carries_the_blocks_chunk_ranges_and_saving_it_does_not_import_pandas(tmp_path):
    import subprocess
    import sys
    import textwrap

    store = _store(tmp_path, 8, producers=("w0", "w1"))
    compact_run(store, "gen", target_bytes=1 << 30)
    script = textwrap.dedent("""
        import sys
        from factory.store import ShardStore, save_manifest
        store = ShardStore(sys.argv[1])
        assert save_manifest(store.manifest_path("gen"), store._read_log("gen"))
        print("pandas" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]
    records = ShardStore(tmp_path)._read_log("gen").records
    assert records.has_blocks and records._ranges == {"w0": (0, 7), "w1": (0, 7)} and not records._irregular
    assert "w0-00000008.parquet" not in records and "w2-00000001.parquet" not in records and records._index is None
    assert "w1-00000007.parquet" in records
