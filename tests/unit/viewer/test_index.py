"""The viewer's run index: families and difficulty, filters, live refresh, problems, drops, trainer metrics."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from factory.viewer.columns import Columns
from factory.viewer.index import Filters, RunIndex, StoreIndex
from tests.unit.viewer.store_fixture import FLOW_RUN_ID, make_group, make_viewer_store, write_chunk


@pytest.fixture
def store(tmp_path):
    return make_viewer_store(tmp_path / "store")


def test_index_has_one_row_per_group_with_family_difficulty_and_lengths(store):
    index = RunIndex(store, "run-1")
    assert index.refresh() == 60
    frame = index.frame
    assert frame.height == 60
    row = frame.filter(pl.col("item_key") == "cipher:2:1").row(0, named=True)
    assert (row["family"], row["difficulty"], row["env"], row["policy_version"]) == ("cipher", 2, "intern_bootcamp", 0)
    assert row["lengths"] == [21] * 4 and row["group_size"] == 4
    gsm = frame.filter(pl.col("env") == "gsm8k")
    assert set(gsm["family"]) == {"gsm8k"} and gsm["difficulty"].null_count() == gsm.height


def test_filters_combine_and_parse_from_query(store):
    index = RunIndex(store, "run-1")
    index.refresh()
    filters = Filters.from_query({"env": "intern_bootcamp", "family": "cipher", "difficulty": "2", "policy_version": "1",
                                  "score_min": "-0.2", "score_max": "", "text": ""})
    got = index.filtered(filters)
    assert got.height > 0
    assert set(got["family"]) == {"cipher"} and set(got["difficulty"]) == {2} and set(got["policy_version"]) == {1}
    assert (got["score_mean"] >= -0.2).all()
    with pytest.raises(ValueError, match="score_min"):
        Filters.from_query({"score_min": "lots"})
    assert index.filtered(Filters()).height == 60


def test_refresh_picks_up_new_shards_and_is_cheap_when_nothing_changed(store):
    index = RunIndex(store, "run-1")
    index.refresh()
    assert index.refresh() == 0
    before = index.columns
    write_chunk(store, "run-1", 3, [make_group(100 + i, "run-1", 3) for i in range(5)])
    assert index.refresh() == 5
    assert index.frame.height == 65 and 3 in set(index.frame["policy_version"])
    appended = index.columns  # built by appending the new shard to the previous columns
    in_commit_order = sorted(index.shards, key=index._order.__getitem__)
    rebuilt = Columns.concat([(index.shards[n].shard_id, index._columns_of[n]) for n in in_commit_order],
                             index._envs, index._families)
    assert appended.size == 65 and before.size == 60
    for name in ("shard", "row", "env", "policy_version", "scores", "lengths", "first", "group_size"):
        assert (getattr(appended, name) == getattr(rebuilt, name)).all(), name
    write_chunk(store, "run-1", 4, [make_group(200 + i, "run-1", 4) for i in range(3)])
    index.refresh()
    again = index.columns  # appended in place into the spare capacity of the same buffers
    assert again.size == 68 and again.shard.base is appended.shard.base and appended.size == 65
    assert (again.policy_version[:65] == appended.policy_version).all() and set(again.policy_version[65:]) == {4}
    assert index.frame["scores"].to_list() == [again.scores[f:f + n].tolist() for f, n in zip(again.first, again.group_size)]
    chosen, used = appended.completions(np.array([0, 64]))
    assert used == 2 and appended.scores[chosen].tolist() == index.frame["scores"][0].to_list() + index.frame["scores"][64].to_list()


def test_a_replaced_chunk_replaces_its_rows(store):
    index = RunIndex(store, "run-1")
    index.refresh()
    store.commit("run-1", "datagen", 0, [make_group(500, "run-1", 9)], replace=True)
    index.refresh()
    assert index.frame.height == 41
    assert index.frame.filter(pl.col("policy_version") == 9).height == 1


def test_a_truncated_shard_is_left_out_and_reported(store):
    path = store.shards_dir("run-1") / "datagen-00000001.parquet"
    path.write_bytes(path.read_bytes()[:100])
    index = RunIndex(store, "run-1")
    index.refresh()
    assert index.frame.height == 40
    assert "size is 100 bytes" in index.problems[str(path)]


def test_difficulty_column_wins_over_the_item_key(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from factory.viewer.index import index_shard

    store = make_viewer_store(tmp_path / "store", chunks=1, per_chunk=4)
    path = store.shards_dir("run-1") / "datagen-00000000.parquet"
    table = pq.read_table(path)
    if "difficulty" in table.column_names:  # the store schema has the column since issue 11; older shards lack it
        table = table.drop_columns(["difficulty"])
    table = table.append_column("difficulty", pa.array([5, None, 3, 3], pa.int32()))
    pq.write_table(table, tmp_path / "with_difficulty.parquet")
    frame = index_shard(tmp_path / "with_difficulty.parquet", 0)
    assert frame["difficulty"].to_list() == [5, 2, 3, 3]  # null falls back to the key "cipher:2:1"


def test_drops_flow_runs_and_read_rows(store):
    index = RunIndex(store, "run-1")
    index.refresh()
    drops = index.drops()
    assert drops["kept"] == 60 and drops["dropped"] == {"failed": 3, "wrong_size": 0, "too_long": 3, "equal_scores": 9}
    assert index.flow_runs() == [{"id": FLOW_RUN_ID, "producer": "datagen", "chunks": 3}]
    rows = index.frame.filter(pl.col("item_key").is_in(["train-44", "arithmetic:1:0"]))
    payload = index.read_rows(rows, ["item_key", "messages"])
    assert [p["item_key"] for p in payload] == rows["item_key"].to_list()
    assert "Question 44" in payload[-1]["messages"] or "Question 44" in payload[0]["messages"]


def test_trainer_metrics_are_found_and_reread_when_they_grow(store):
    index = RunIndex(store, "run-1")
    assert index.train_metrics() == (None, [])
    path = store.run_dir("run-1") / "train" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"step": 1, "reward_mean": 0.1}) + "\n")
    assert index.train_metrics()[1] == [{"step": 1, "reward_mean": 0.1}]
    with open(path, "a") as handle:
        handle.write(json.dumps({"step": 2, "reward_mean": 0.3}) + "\nnot json\n")
    assert [row["step"] for row in index.train_metrics()[1]] == [1, 2]


def test_store_index_lists_runs_and_refuses_unknown_ones(store):
    stores = StoreIndex(store)
    assert stores.run_ids() == ["run-1"]
    assert stores.run("run-1").frame.height == 60
    with pytest.raises(KeyError):
        stores.run("nope")


def test_a_budgeted_refresh_indexes_newest_shards_first_and_keeps_commit_order(store):
    index = RunIndex(store, "run-1")
    assert index.refresh(budget_s=0) == 20
    assert index.pending == 2 and set(index.frame["policy_version"]) == {2}  # the newest chunk
    assert index.refresh() == 40 and index.pending == 0
    assert index.frame["policy_version"].to_list() == [0] * 20 + [1] * 20 + [2] * 20


@pytest.fixture
def stats_reads(monkeypatch) -> list[str]:
    """Names of the stats files read (Path.read_text) from here on, in order."""
    from pathlib import Path

    reads: list[str] = []
    read_text = Path.read_text

    def counted(self, *args, **kwargs):
        if self.name.startswith("stats-"):
            reads.append(self.name)
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counted)
    return reads


def test_stats_files_are_read_again_only_when_new_or_changed(store, stats_reads):
    reads = stats_reads
    index = RunIndex(store, "run-1")
    index.refresh()
    assert sorted(reads) == [f"stats-datagen-{chunk:08d}.json" for chunk in range(3)]
    reads.clear()
    write_chunk(store, "run-1", 3, [make_group(60 + i, "run-1", 3) for i in range(5)])
    changed = {"groups_kept": 7, "dropped": {"failed": 2}}
    store.write_run_file("run-1", "stats-datagen-00000001.json", json.dumps(changed))
    store.write_run_file("run-1", "stats-datagen.json", json.dumps({"groups_kept": 99, "flow_run_id": "other"}))
    index.refresh()
    assert sorted(reads) == ["stats-datagen-00000001.json", "stats-datagen-00000003.json", "stats-datagen.json"]
    fresh = RunIndex(store, "run-1")
    fresh.refresh()
    assert index.chunk_stats == fresh.chunk_stats and index.run_stats == fresh.run_stats
    assert index.drops() == fresh.drops() and index.drops()["kept"] == 20 + 7 + 20 + 5
    assert index.flow_runs() == fresh.flow_runs()
    (store.run_dir("run-1") / "stats-datagen-00000000.json").unlink()
    index.refresh()
    assert (0 not in {chunk for _, chunk in index.chunk_stats}) and index.drops()["kept"] == 7 + 20 + 5


def test_drops_and_flow_runs_are_the_same_after_folding_and_a_segment_is_read_once(store, stats_reads):
    from pathlib import Path

    from factory.chunk_stats import fold, segment_name, write_segment

    fresh = RunIndex(store, "run-1")
    fresh.refresh()
    before = (fresh.drops(), fresh.flow_runs(), dict(fresh.chunk_stats))
    reads, read_text = stats_reads, Path.read_text  # (reads before `reads.clear()` below are not asserted on)
    index = RunIndex(store, "run-1")
    index.refresh()
    chunks = {k: json.loads(read_text(store.run_dir("run-1") / f"stats-datagen-{k:08d}.json")) for k in (0, 1)}
    write_segment(store, "run-1", "datagen", chunks)  # a fold killed before it deleted the files
    reads.clear()
    index.refresh()
    assert reads == [segment_name("datagen", 0, 1)]
    assert (index.drops(), index.flow_runs(), index.chunk_stats) == before
    fold(store, "run-1", "datagen", chunks)  # the files go (the segment is rewritten with the same content)
    reads.clear()
    index.refresh()
    assert reads == [] and (index.drops(), index.flow_runs(), index.chunk_stats) == before
    folded = RunIndex(store, "run-1")
    folded.refresh()
    assert (folded.drops(), folded.flow_runs(), folded.chunk_stats) == before and folded.run_stats == {}


def test_drops_and_flow_runs_are_computed_once_per_set_of_stats_files(store):
    index = RunIndex(store, "run-1")
    index.refresh()
    drops, runs = index.drops(), index.flow_runs()
    index.refresh()  # nothing new
    assert index.drops() is drops and index.flow_runs() is runs
    write_chunk(store, "run-1", 3, [make_group(60 + i, "run-1", 3) for i in range(5)])
    index.refresh()
    assert index.drops()["kept"] == drops["kept"] + 5 and index.flow_runs()[0]["chunks"] == runs[0]["chunks"] + 1
