"""The shard store: atomic commits, no duplicates on retry, corrupt shards reported and left out."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import datasets
import polars as pl
import pyarrow.dataset as ds
import pytest

from environments.groups import ScoredGroup
from factory.store import ShardStore, StoreError, shard_name
from factory.synthetic import synthetic_groups


def groups(count: int, start: int = 0, **kwargs) -> list[ScoredGroup]:
    return list(synthetic_groups(count, start=start, group_size=4, seq_len=16, **kwargs))


def test_commit_then_read_back_in_commit_order(store_root):
    store = ShardStore(store_root)
    store.commit("run", "w0", 1, groups(3, start=3))
    store.commit("run", "w0", 0, groups(3))
    got = [g.item_key for g in store.iter_groups("run")]
    assert got == [f"item-{i}" for i in (3, 4, 5, 0, 1, 2)]
    assert store.count("run") == 6
    assert store.runs() == ["run"]
    assert list(store.iter_groups("run"))[0] == groups(1, start=3)[0]


def test_retried_chunk_is_skipped_and_replace_rewrites_without_duplicates(store_root):
    store = ShardStore(store_root)
    first = store.commit("run", "w0", 0, groups(3))
    again = store.commit("run", "w0", 0, groups(5))
    assert again.skipped and again.sha256 == first.sha256
    assert store.count("run") == 3
    replaced = store.commit("run", "w0", 0, groups(2, start=10), replace=True)
    assert not replaced.skipped
    assert [g.item_key for g in store.iter_groups("run")] == ["item-10", "item-11"]
    assert len(list((store_root / "run" / "shards").glob("*.parquet"))) == 1


def test_empty_chunk_commits_a_marker(store_root):
    store = ShardStore(store_root)
    record = store.commit("run", "w0", 7, [])
    assert record.rows == 0 and store.is_committed("run", "w0", 7)
    assert list(store.iter_groups("run")) == []


def test_invalid_group_dict_aborts_commit_and_leaves_nothing(store_root):
    store = ShardStore(store_root)
    bad = groups(1)[0].model_dump() | {"masks": [[1]]}
    with pytest.raises(ValueError, match=r"group 1 of the chunk is invalid: masks has 1 entries but tokens has 4"):
        store.commit("run", "w0", 0, [groups(1)[0], bad])
    assert not store.is_committed("run", "w0", 0)
    assert list((store_root / "run" / "shards").iterdir()) == []


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_shard_is_reported_with_its_path_and_left_out(store_root, damage, caplog):
    store = ShardStore(store_root)
    store.commit("run", "w0", 0, groups(2))
    store.commit("run", "w0", 1, groups(2, start=2))
    path = store_root / "run" / "shards" / shard_name("w0", 0)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        middle = len(data) // 3
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :])
    else:
        path.unlink()
    if damage == "flip":
        # Same size: the sha256 check catches it, and page checksums catch it while reading.
        assert [p.path for p in store.verify("run")] == [str(path)]
    keys = [g.item_key for g in store.iter_groups("run")]
    assert keys == ["item-2", "item-3"]
    assert [p.path for p in store.problems] == [str(path)]
    assert str(path) in caplog.text


def test_torn_commit_log_line_is_ignored(store_root):
    store = ShardStore(store_root)
    store.commit("run", "w0", 0, groups(2))
    with open(store.commit_log("run"), "a") as log:
        log.write('{"shard": "w0-00000001.parquet", "rows"')
    assert store.count("run") == 2
    assert not store.is_committed("run", "w0", 1)


def _commit_forever(root: str) -> None:
    store = ShardStore(root)
    chunk = 0
    while True:
        store.commit("run", "w0", chunk, groups(20, start=chunk * 20))
        chunk += 1


def test_kill_during_writes_never_exposes_partial_or_duplicate_shards(store_root):
    process = multiprocessing.get_context("spawn").Process(target=_commit_forever, args=(str(store_root),))
    process.start()
    deadline = time.monotonic() + 60
    store = ShardStore(store_root)
    while store.count("run") < 60 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.037)
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    committed = store.count("run")
    assert committed >= 60
    keys = [g.item_key for g in store.iter_groups("run")]
    assert len(keys) == len(set(keys)) == committed
    assert store.verify("run") == []
    # A rerun of the same chunks skips what was committed and fills in the rest.
    for chunk in range(committed // 20 + 2):
        store.commit("run", "w0", chunk, groups(20, start=chunk * 20))
    keys = [g.item_key for g in store.iter_groups("run")]
    assert len(keys) == len(set(keys)) == (committed // 20 + 2) * 20


def test_other_tools_read_the_store_directly(store_root):
    store = ShardStore(store_root)
    store.commit("run", "w0", 0, groups(3))
    store.commit("run", "w1", 0, groups(2, start=3))
    shards = store_root / "run" / "shards"
    (shards / ".w2-00000000.parquet.abc.tmp").write_bytes(b"half a shard")  # a writer mid-flight

    frame = pl.scan_parquet(str(shards / "*.parquet")).select("item_key", "scores").collect()
    assert sorted(frame["item_key"].to_list()) == [f"item-{i}" for i in range(5)]
    assert frame["scores"].to_list()[0] == groups(1)[0].scores

    assert ds.dataset(str(shards), format="parquet").count_rows() == 5
    assert store.dataset("run").to_table(columns=["group_id"]).num_rows == 5

    loaded = datasets.load_dataset("parquet", data_files=str(shards / "*.parquet"), split="train")
    assert len(loaded) == 5 and loaded[0]["tokens"][0][:3] == groups(1)[0].tokens[0][:3]
    assert json.loads(loaded[0]["messages"])[0][0]["role"] == "user"


def test_streaming_reads_hold_one_batch_at_a_time(store_root):
    store = ShardStore(store_root)
    store.commit("run", "w0", 0, groups(200))
    sizes = [batch.num_rows for batch in store.iter_batches("run", columns=["group_id"], batch_size=32)]
    assert max(sizes) == 32 and sum(sizes) == 200


def test_url_roots_and_bad_names_fail_clearly(tmp_path: Path):
    with pytest.raises(StoreError, match="mounted"):
        ShardStore("s3://bucket/data")
    assert ShardStore(f"file://{tmp_path}").root == tmp_path
    with pytest.raises(ValueError, match="run_id '../x'"):
        ShardStore(tmp_path).commit("../x", "w0", 0, [])


def test_run_files_are_written_atomically(store_root):
    store = ShardStore(store_root)
    path = store.write_run_file("run", "config.yaml", "a: 1\n")
    assert path.read_text() == "a: 1\n"
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]
