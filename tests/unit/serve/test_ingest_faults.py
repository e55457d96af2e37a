"""run-api when the disk fills: a storage failure answers 503 with Retry-After on a connection that stays usable,
an acknowledged group is never lost, and a retried post (same Idempotency-Key) is never stored or served twice."""

from __future__ import annotations

import errno
import http.client
import sqlite3
import threading
import time
from typing import Any

import orjson
import polars as pl
import uvicorn

from bench.store_faults.inject import Plan, inject
from factory.serve.app import create_app
from factory.serve.config import ServeConfig
from factory.serve.service import BatchService
from factory.store import ShardStore
from factory.synthetic import synthetic_groups
from tests.conftest import free_port

REGISTRATION = dict(wandb_group="g", wandb_project="p", batch_size=2, max_token_len=64, checkpoint_dir="c",
                    save_checkpoint_interval=-1, starting_step=0, num_steps=100)


class FailingDB:
    """The served state's SQLite connection, whose writes fail like a full disk while `failing` is set."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db, self.failing = db, False

    def _check(self, sql: str) -> None:
        if self.failing and sql.split(None, 1)[0].upper() in ("INSERT", "UPDATE", "DELETE", "REPLACE"):
            raise sqlite3.OperationalError("database or disk is full")

    def execute(self, sql: str, *args: Any) -> Any:
        self._check(sql)
        return self.db.execute(sql, *args)

    def executemany(self, sql: str, *args: Any) -> Any:
        self._check(sql)
        return self.db.executemany(sql, *args)

    def __enter__(self) -> Any:
        return self.db.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.db.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)


class Api:
    """run-api's app on a real uvicorn server in a thread (so faults can be injected into its process)."""

    def __init__(self, root) -> None:
        self.config = ServeConfig(store_root=str(root), follow_interval_s=0.05, prefetch=False, batch_metadata=True)
        self.service = BatchService(self.config)
        self.db = FailingDB(self.service.state.db)
        self.service.state.db = self.db
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.config, self.service), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Api:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "run-api did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def body(index: int) -> bytes:
    group = next(iter(synthetic_groups(1, start=index, group_size=2, seq_len=8))).wire_dict()
    group.pop("group_id", None)  # identified by the Idempotency-Key
    return orjson.dumps(group)


def post(conn: http.client.HTTPConnection, key: str, index: int) -> http.client.HTTPResponse:
    conn.request("POST", "/scored_data", body(index), {"Content-Type": "application/json", "Idempotency-Key": key})
    response = conn.getresponse()
    response.data = response.read()
    return response


def served_ids(conn: http.client.HTTPConnection) -> list[str]:
    ids = []
    while True:
        conn.request("GET", "/batch")
        response = conn.getresponse()
        data = orjson.loads(response.read())
        assert response.status == 200, data
        if not data.get("batch"):
            return ids
        ids += [group["group_id"] for group in data["batch"]]


def test_full_disk_answers_503_and_a_retry_is_never_stored_twice(tmp_path):
    with Api(tmp_path) as api:
        conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=30)
        assert post(conn, "a", 0).status == 200
        sock = conn.sock

        # The shard commits but the state DB is full: the groups are durable, so the post is acknowledged,
        # and a retry while the DB is still full stores nothing.
        api.db.failing = True
        assert post(conn, "b", 1).status == 200
        assert post(conn, "b", 1).status == 200
        assert ShardStore(tmp_path).count("api") == 2

        # The store itself is full (the commit record cannot be written): 503 with Retry-After, same connection.
        with inject(Plan("log-write", errno.ENOSPC)):
            response = post(conn, "c", 2)
        assert response.status == 503 and response.getheader("retry-after") == "1", response.data
        assert b"commits.jsonl" in response.data  # names the path
        assert conn.sock is sock, "the connection was closed after the error"

        # Served state cannot record a batch: 503, and the batch's groups stay queued.
        api.db.failing = False
        conn.request("POST", "/register", orjson.dumps(REGISTRATION), {"Content-Type": "application/json"})
        assert conn.getresponse().read()
        api.db.failing = True
        conn.request("GET", "/batch")
        response = conn.getresponse()
        assert response.status == 503 and response.getheader("retry-after") == "1", response.read()
        response.read()
        assert conn.sock is sock

        # Space is freed: retries of every post; c is stored now, a and b are not stored again.
        api.db.failing = False
        for key, index in (("a", 0), ("b", 1), ("c", 2), ("c", 2)):
            assert post(conn, key, index).status == 200
        time.sleep(0.3)  # the follower indexes b's shard, which the full state DB could not note
        served = served_ids(conn)
        assert sorted(served) == ["a", "b", "c"]
        assert conn.sock is sock
        conn.close()

    store = ShardStore(tmp_path)
    ids = [g.group_id for g in store.iter_groups("api")]
    assert sorted(ids) == ["a", "b", "c"]
    assert sorted(pl.scan_parquet(str(store.shards_dir("api") / "*.parquet")).collect()["group_id"].to_list()) == ids
    assert store.verify("api") == []

    # After a restart: a retry is still recognised, and nothing is served again.
    with Api(tmp_path) as api:
        conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=30)
        assert post(conn, "b", 1).status == 200
        assert served_ids(conn) == []
        conn.close()
    assert ShardStore(tmp_path).count("api") == 3


def test_commit_that_fails_after_its_record_is_durable_is_acknowledged_once(tmp_path):
    with Api(tmp_path) as api:
        conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=30)
        with inject(Plan("rename", errno.EIO)):
            assert post(conn, "a", 0).status == 200
        assert post(conn, "a", 0).status == 200
        conn.request("POST", "/register", orjson.dumps(REGISTRATION), {"Content-Type": "application/json"})
        conn.getresponse().read()
        assert served_ids(conn) == ["a"]
        conn.close()
    assert ShardStore(tmp_path).count("api") == 1 and ShardStore(tmp_path).verify("api") == []


def test_a_commit_cut_short_before_its_rename_is_recognised_after_a_restart(tmp_path):
    """SIGKILL between a post's durable commit record and its rename: after the restart the retry stores nothing."""
    import asyncio

    cfg = ServeConfig(store_root=str(tmp_path), follow_interval_s=0.05, prefetch=False, batch_metadata=True)
    group = next(iter(synthetic_groups(1, group_size=2, seq_len=8)))
    group.run_id = cfg.ingest_run
    with inject(Plan("rename")):  # what the killed process left: the record in the log, the shard still hidden
        ShardStore(tmp_path).commit(cfg.ingest_run, cfg.ingest_producer, 0, [group])
    assert list(ShardStore(tmp_path).shards_dir(cfg.ingest_run).glob("*.parquet")) == []

    async def scenario() -> tuple[int, list[str]]:
        service = BatchService(cfg)
        await service.start()
        stored = await service.ingest([group.model_copy()])  # the client's retry
        await service.register({**REGISTRATION, "batch_size": 2})
        served = []
        while (body := (await service.next_batch(False)).raw) and orjson.loads(body).get("batch"):
            served += [g["group_id"] for g in orjson.loads(body)["batch"]]
        await service.stop()
        return stored, served

    stored, served = asyncio.run(scenario())
    assert stored == 0 and served == [group.group_id]
    assert ShardStore(tmp_path).count(cfg.ingest_run) == 1 and ShardStore(tmp_path).verify(cfg.ingest_run) == []
