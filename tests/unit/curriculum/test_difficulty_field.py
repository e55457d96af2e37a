"""The optional `difficulty` field: stored, read back, and null for shards written before it existed."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from environments.groups import ScoredGroup
from factory.schema import GROUP_SCHEMA, groups_to_record_batch, record_batch_to_groups
from factory.store import ShardStore


def group(difficulty):
    return ScoredGroup(tokens=[[1, 2], [1, 3]], masks=[[-100, 2], [-100, 3]], scores=[1.0, -0.5], item_key="a:3:1",
                       env="intern_bootcamp", difficulty=difficulty)


def test_difficulty_round_trips_through_the_store(tmp_path):
    store = ShardStore(tmp_path)
    store.commit("r", "p", 0, [group(3), group(None)])
    assert [g.difficulty for g in store.iter_groups("r")] == [3, None]
    assert store.dataset("r").to_table(filter=ds.field("difficulty") == 3).num_rows == 1


def test_old_shards_without_the_column_read_as_null(tmp_path):
    batch = groups_to_record_batch([group(4)])
    old = batch.drop_columns(["difficulty"])
    pq.write_table(pa.Table.from_batches([old]), tmp_path / "old.parquet")
    table = pq.read_table(tmp_path / "old.parquet")
    assert "difficulty" not in table.column_names
    assert [g.difficulty for g in record_batch_to_groups(table)] == [None]
    read = ds.dataset(str(tmp_path / "old.parquet"), schema=GROUP_SCHEMA, format="parquet").to_table()
    assert read.column("difficulty").to_pylist() == [None]
