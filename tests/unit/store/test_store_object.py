"""The shard store on an S3-compatible object store: a local moto server started (and stopped) by the test."""

import pyarrow as pa
import pytest

from factory.store import StoreError
from factory.store_object import ObjectShardStore, open_store
from factory.synthetic import synthetic_groups
from tests.moto_s3 import bucket, no_credentials, s3_endpoint  # noqa: F401 - fixtures


def test_commit_and_read_back_groups(bucket):
    fs, name = bucket
    store = open_store(f"s3://{name}/stores/a")
    assert isinstance(store, ObjectShardStore)
    first = list(synthetic_groups(5, group_size=2, seq_len=8, env="e"))
    second = list(synthetic_groups(3, start=100, group_size=2, seq_len=8, env="e"))
    record = store.commit("run", "w0", 0, first)
    assert record.rows == 5 and not record.skipped
    store.commit("run", "w0", 1, second)
    again = store.commit("run", "w0", 0, first)  # a retried chunk stores nothing twice
    assert again.skipped
    assert list(store.committed("run")) == [record.shard, "w0-00000001.parquet"]
    groups = list(store.iter_groups("run"))
    assert [g.group_id for g in groups] == [g.group_id for g in first + second]
    assert store.count("run") == 8
    assert store.runs() == ["run"]


def test_a_shard_object_without_its_record_is_invisible(bucket):
    fs, name = bucket
    store = ObjectShardStore(f"s3://{name}/s")
    store.commit("run", "w0", 0, list(synthetic_groups(2, group_size=2, seq_len=8, env="e")))
    # A writer killed between its two PUTs: the shard object exists, its commit record does not.
    with fs.open_output_stream(store.shard_path("run", "w0-00000009.parquet")) as out:
        out.write(b"torn or whole, it does not matter")
    assert list(store.committed("run")) == ["w0-00000000.parquet"]
    assert len(list(store.iter_groups("run"))) == 2


def test_batches_from_an_arrow_table(bucket):
    _, name = bucket
    from factory.schema import groups_to_record_batch

    store = ObjectShardStore(f"s3://{name}")
    table = pa.Table.from_batches([groups_to_record_batch(list(synthetic_groups(4, group_size=2, seq_len=8, env="e")))])
    store.commit("run", "w1", 3, table)
    assert sum(b.num_rows for b in store.iter_batches("run", columns=["group_id"])) == 4


def test_missing_credentials_is_one_line(no_credentials):
    with pytest.raises(StoreError) as error:
        open_store("s3://bucket/prefix")
    assert "\n" not in str(error.value) and "AWS_ACCESS_KEY_ID" in str(error.value)


def test_a_missing_bucket_is_one_line(bucket):
    with pytest.raises(StoreError) as error:
        open_store("s3://no-such-bucket/prefix").runs()
    assert "\n" not in str(error.value) and "'no-such-bucket'" in str(error.value) and "does not exist" in str(error.value)


def test_changes_return_each_new_record_once(bucket):
    _, name = bucket
    store = open_store(f"s3://{name}/s")
    store.commit("run", "w0", 0, list(synthetic_groups(2, group_size=2, seq_len=8, env="e")))
    cursor, first = store.changes("run")
    assert [r.shard for r in first] == ["w0-00000000.parquet"]
    cursor, none = store.changes("run", cursor)
    assert none == []
    other = open_store(f"s3://{name}/s")  # another writer (process) commits; this reader sees only the new record
    other.commit("run", "w1", 0, list(synthetic_groups(2, start=10, group_size=2, seq_len=8, env="e")))
    cursor, second = store.changes("run", cursor)
    assert [r.shard for r in second] == ["w1-00000000.parquet"]
    path, offset, rows = store.locate("run", "w1-00000000.parquet")
    assert store.file_size(path) == second[0].bytes and (offset, rows) == (0, 2)
