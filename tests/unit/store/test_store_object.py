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


def test_verify_checks_each_live_object_against_its_record(bucket):
    fs, name = bucket
    store = ObjectShardStore(f"s3://{name}/v")
    for chunk in range(3):
        store.commit("run", "w0", chunk, list(synthetic_groups(2, start=10 * chunk, group_size=2, seq_len=8, env="e")))
    with fs.open_output_stream(store.shard_path("run", "w0-00000009.parquet")) as out:  # a commit cut short
        out.write(b"no record: never read, not a problem")
    assert store.verify("run") == []

    shard = store.shard_path("run", "w0-00000001.parquet")
    with fs.open_input_stream(shard) as handle:
        data = handle.read()
    with fs.open_output_stream(shard) as out:  # same size, one byte changed
        out.write(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    fs.delete_file(store.shard_path("run", "w0-00000002.parquet"))
    problems = store.verify("run")
    assert sorted((p.kind, p.path.rsplit("/", 1)[1]) for p in problems) == [
        ("missing", "w0-00000002.parquet"), ("sha256", "w0-00000001.parquet")]
    assert problems[0].path.startswith(f"s3://{name}/v/run/shards/")


def test_verify_finds_a_group_stored_in_two_objects(bucket):
    _, name = bucket
    store = ObjectShardStore(f"s3://{name}/d")
    groups = list(synthetic_groups(2, group_size=2, seq_len=8, env="e"))
    store.commit("run", "w0", 0, groups)
    store.commit("run", "w1", 0, groups)  # two producers wrote the same groups
    (problem,) = store.verify("run")
    assert problem.kind == "duplicate" and "2 group ids are also stored in w0-00000000.parquet" in problem.reason


def test_verify_reports_a_damaged_record_as_one_problem(bucket):
    fs, name = bucket
    store = ObjectShardStore(f"s3://{name}/r")
    store.commit("run", "w0", 0, list(synthetic_groups(2, group_size=2, seq_len=8, env="e")))
    with fs.open_output_stream(f"{name}/r/run/commits/w0-00000001.parquet.json") as out:
        out.write(b'{"shard": "w0-0000')
    (problem,) = ObjectShardStore(f"s3://{name}/r").verify("run")
    assert problem.kind == "bad-line" and problem.path == f"s3://{name}/r/run/commits"


def test_factory_store_verify_on_an_object_store(bucket, capsys):
    from factory.store_cli import main as store_cli

    fs, name = bucket
    url = f"s3://{name}/c"
    store = ObjectShardStore(url)
    store.commit("run", "w0", 0, list(synthetic_groups(2, group_size=2, seq_len=8, env="e")))
    assert store_cli(["verify", url]) == 0
    assert "run: 1 committed shards, 2 groups, consistent" in capsys.readouterr().out
    with fs.open_output_stream(f"{name}/c/run/commits/w0-00000001.parquet.json") as out:
        out.write(b"{")
    assert store_cli(["verify", url, "run"]) == 1
    out = capsys.readouterr().out
    assert "run: bad-line: " in out and out.strip().splitlines()[-1] == "run: 1 problems"


def test_a_url_with_its_own_endpoint_commits_with_one_put_per_object(bucket, s3_endpoint, monkeypatch):
    """The from_uri path (no AWS_ENDPOINT_URL): the URL's query is kept and small objects are written whole at close."""
    fs, name = bucket
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    url = f"s3://{name}/u?endpoint_override={s3_endpoint.split('://')[1]}&scheme=http&region=us-east-1"
    store = ObjectShardStore(url)
    assert store.base == f"{name}/u"
    store.commit("run", "w0", 0, list(synthetic_groups(2, group_size=2, seq_len=8, env="e")))
    import pyarrow.fs as pafs

    assert sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(f"{name}/u/run", recursive=True))
                  if i.type == pafs.FileType.File) == ["w0-00000000.parquet", "w0-00000000.parquet.json"]
    assert len(list(ObjectShardStore(url).iter_groups("run"))) == 2


def test_records_carry_the_index_summary_and_a_scan_reads_no_shard(bucket, monkeypatch):
    """As on a local store (tests/unit/store/test_commit_summary.py): the record's summary is the shard's index
    columns, and the follower's scan takes them from there (a HEAD per shard for its size, no GET of its footer)."""
    from factory.index_runs import plain
    from factory.serve import follower

    _, name = bucket
    store = ObjectShardStore(f"s3://{name}/summary")
    for chunk in range(3):
        store.commit("run", "w0", chunk, list(synthetic_groups(4, start=4 * chunk, group_size=2, seq_len=8, env="e")))
    expected = {shard: follower.read_index(store.shard_path("run", shard), store.filesystem)
                for shard in store.committed("run")}
    records = ObjectShardStore(f"s3://{name}/summary").committed("run")
    assert all(r.index == {"env": ["e"], "runs": [[0, None, 0, 2, 4]]} for r in records.values())

    def refuse(*args, **kwargs):
        raise AssertionError("a shard's index columns read though its record has them")

    monkeypatch.setattr(follower, "read_index", refuse)
    found = follower.scan_new_shards(ObjectShardStore(f"s3://{name}/summary"), ["run"], set(), set())
    assert [s.shard for s in found] == list(records)
    for shard in found:
        assert plain(shard.index).equals(expected[shard.shard].cast(plain(shard.index).schema))


def test_a_chunk_grouped_as_columns_is_written_as_its_scoredgroups(bucket):
    from environments.base import Item, Rollout
    from tasks.group import group_chunk

    fs, name = bucket
    items = [Item(key=f"k{i}", messages=[{"role": "user", "content": f"q{i}"}]) for i in range(4)]
    rollouts = [[Rollout(item.key, f"a{j}", [1, 2, i], [3, j], None, "stop", 0, score=float(j)) for j in range(2)]
                for i, item in enumerate(items)]
    grouped = group_chunk("e", items, rollouts, group_size=2, max_token_length=10, run_id="run")
    as_groups = list(grouped.groups)
    columns_store, groups_store = open_store(f"s3://{name}/columns"), open_store(f"s3://{name}/groups")
    written = columns_store.commit("run", "w0", 0, grouped)
    before = groups_store.commit("run", "w0", 0, as_groups)
    assert (written.rows, written.sha256) == (before.rows, before.sha256) == (4, before.sha256)
    assert [g.model_dump() for g in columns_store.iter_groups("run")] == [g.model_dump() for g in as_groups]
