"""The follower's scans cost what changed since the last scan, yet miss nothing the caller has not indexed."""

from __future__ import annotations

from factory.commit_log import decode_line, encode_line
from factory.serve.follower import scan_new_shards
from factory.store import ShardStore
from factory.store_compact import compact_run
from factory.synthetic import synthetic_groups


def commit(store: ShardStore, chunk: int) -> None:
    store.commit("r", "w0", chunk, synthetic_groups(3, start=3 * chunk, group_size=2, seq_len=8))


def test_scans_return_new_shards_once_known_and_again_until_known(tmp_path):
    store = ShardStore(tmp_path)
    for chunk in range(3):
        commit(store, chunk)
    known: set[tuple[str, str]] = set()
    first = scan_new_shards(store, ["r"], known, set())
    assert [s.shard for s in first] == [f"w0-0000000{i}.parquet" for i in range(3)]
    known.update(("r", s.shard) for s in first[:2])  # the caller failed to index the third one
    commit(store, 3)
    second = scan_new_shards(store, ["r"], known, set())
    assert sorted(s.shard for s in second) == ["w0-00000002.parquet", "w0-00000003.parquet"]
    known.update(("r", s.shard) for s in second)
    assert scan_new_shards(store, ["r"], known, set()) == []


def without_summaries(store: ShardStore, run_id: str) -> None:
    """The run's commit log as a store before commit records carried their index summary wrote it."""
    log = store.commit_log(run_id)
    log.write_bytes(b"".join(encode_line({k: v for k, v in decode_line(line).items() if k not in ("index", "check")})
                             for line in log.read_bytes().splitlines()))
    store.manifest_path(run_id).unlink(missing_ok=True)


def test_an_unreadable_shard_is_retried_and_compacted_shards_come_with_their_offset(tmp_path):
    store = ShardStore(tmp_path)
    for chunk in range(4):
        commit(store, chunk)
    without_summaries(store, "r")  # records of before: each shard is opened (with a summary it is not: see
    store = ShardStore(tmp_path)   # tests/unit/store/test_commit_summary.py)
    path = store.shards_dir("r") / "w0-00000001.parquet"
    data = path.read_bytes()
    path.write_bytes(b"x" * len(data))  # same size, unreadable
    reported: set[str] = set()
    got = scan_new_shards(store, ["r"], set(), reported)
    assert [s.shard for s in got] == ["w0-00000000.parquet", "w0-00000002.parquet", "w0-00000003.parquet"]
    assert reported == {str(path)}
    path.write_bytes(data)
    known = {("r", s.shard) for s in got}
    assert [s.shard for s in scan_new_shards(store, ["r"], known, reported)] == ["w0-00000001.parquet"]
    compact_run(store, "r", target_bytes=1 << 30)
    fresh = scan_new_shards(ShardStore(tmp_path), ["r"], set(), set())  # a restarted follower
    assert [(s.shard, s.row_offset, s.rows) for s in fresh] == [(f"w0-0000000{i}.parquet", 3 * i, 3) for i in range(4)]
    assert len({s.path for s in fresh}) == 1
    assert fresh[2].index.num_rows == 3
