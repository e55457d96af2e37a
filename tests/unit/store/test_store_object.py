"""The shard store on an S3-compatible object store: a local moto server started (and stopped) by the test."""

import socket
import subprocess
import sys
import time
import urllib.request

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from factory.store import StoreError
from factory.store_object import ObjectShardStore, open_store
from factory.synthetic import synthetic_groups



def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint():
    pytest.importorskip("moto", minversion="5.2.5")  # 5.2.1 answers pyarrow's CompleteMultipartUpload with an error
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(endpoint, timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture
def bucket(s3_endpoint, monkeypatch, request):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    name = f"b-{request.node.name.replace('_', '-')[:40].lower()}"
    fs = pafs.S3FileSystem(endpoint_override=s3_endpoint.split("://")[1], scheme="http", region="us-east-1",
                           access_key="testing", secret_key="testing", allow_bucket_creation=True)
    fs.create_dir(name)
    return fs, name


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


def test_missing_credentials_is_one_line(monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    with pytest.raises(StoreError) as error:
        open_store("s3://bucket/prefix")
    assert "\n" not in str(error.value) and "AWS_ACCESS_KEY_ID" in str(error.value)
