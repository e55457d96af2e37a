"""Compaction records a merged file's index columns as runs; run-api's start-up makes them from the runs instead of
reading the file, and queues exactly what reading it would have queued."""

from __future__ import annotations

import asyncio
import random

import pyarrow as pa
import pytest

from factory.index_runs import INDEX_COLUMNS, plain, rows_of, summarize, table_of
from factory.serve import follower
from factory.serve.config import ServeConfig
from factory.serve.service import BatchService
from factory.store import ShardStore
from factory.store_compact import checkpoint, compact_run
from factory.synthetic import synthetic_groups


@pytest.mark.parametrize("seed", range(4))
def test_runs_stand_for_the_columns(seed):
    rng = random.Random(seed)
    env, env_id, version, size = [], [], [], []
    for _ in range(rng.randint(1, 12)):
        name = rng.choice(["a", "b", "ünï"])
        run = (name, rng.choice([None, 0, 3]), rng.randint(0, 5), rng.choice([1, 2, 8]))
        for _ in range(rng.randint(10, 40)):
            for column, value in zip((env, env_id, version, size), run):
                column.append(value)
    table = pa.table({"env": pa.array(env, pa.string()), "env_id": pa.array(env_id, pa.int64()),
                      "policy_version": pa.array(version, pa.int64()), "group_size": pa.array(size, pa.int32())})
    summary = summarize(table)
    assert summary is not None and rows_of(summary) == table.num_rows
    made = table_of(summary)
    assert made.equals(table.select(INDEX_COLUMNS).cast(made.schema))
    assert plain(made).schema.field("env").type == pa.string()
    assert plain(made).equals(table.select(INDEX_COLUMNS).cast(plain(made).schema))
    assert table_of(summarize(table.slice(0, 0))).num_rows == 0


def test_rows_that_change_too_often_get_no_summary():
    table = pa.table({"env": ["a", "b"] * 50, "env_id": pa.array([None] * 100, pa.int64()),
                      "policy_version": pa.array([1] * 100, pa.int64()), "group_size": pa.array([2] * 100, pa.int32())})
    assert summarize(table) is None


def test_a_start_up_after_compaction_reads_no_index_column(tmp_path, monkeypatch):
    store = ShardStore(tmp_path)
    for chunk in range(8):  # two envs, two policy versions: a few runs per file
        groups = list(synthetic_groups(20, start=chunk * 20, group_size=2, seq_len=8))
        for group in groups:
            group.env, group.env_id = ("a", 0) if chunk < 5 else ("b", None)
            group.policy_version = chunk // 3
        store.commit("gen", "w0", chunk, groups)
    expected = ShardStore(tmp_path)
    compact_run(store, "gen", target_bytes=1 << 30)
    checkpoint(store, "gen")
    (file,) = ShardStore(tmp_path)._read_log("gen").files
    summary = ShardStore(tmp_path).index_summary("gen", file)
    assert summary is not None and rows_of(summary) == 160
    assert plain(table_of(summary)).equals(follower.read_index(tmp_path / "gen" / "shards" / file))
    del expected

    def refuse(*args, **kwargs):
        raise AssertionError("index columns read from a file with a summary")

    monkeypatch.setattr(follower, "read_index", refuse)
    cfg = ServeConfig(store_root=str(tmp_path), follow_interval_s=3600, follow_runs=["gen"])

    async def life() -> tuple[int, dict]:
        service = BatchService(cfg)
        await service.start()
        result = service.queue.groups, dict(service.queue.lane_groups)
        await service.stop()
        return result

    groups, lanes = asyncio.run(life())
    assert groups == 160 and sorted(lanes.values()) == [60, 100]
    assert asyncio.run(life()) == (groups, lanes)  # a restart from the served state's block: no read either
