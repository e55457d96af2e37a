"""A commit record carries its shard's index columns as runs (factory/index_runs.py); run-api's scan and restart take
them from there instead of opening every shard, and queue exactly what reading the shards queues. Records without a
summary (written before), or with one that does not add up to the record's rows, are read from the file as before."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3

import pyarrow as pa
import pytest

from bench.shards.startup_ab import queue_digest
from factory.commit_log import decode_line, encode_line
from factory.index_runs import INDEX_COLUMNS, plain, summarize_rows, table_of, table_of_many
from factory.schema import groups_to_record_batch
from factory.serve import follower
from factory.serve.config import ServeConfig
from factory.serve.service import BatchService
from factory.store import ShardStore, save_manifest
from factory.synthetic import synthetic_groups

RUN = "gen"


def groups_of(chunk: int, count: int = 6) -> list:
    """Groups whose env, env_id, version and size change inside the shard and from shard to shard."""
    groups = list(synthetic_groups(count, start=chunk * count, group_size=2, seq_len=8))
    for i, group in enumerate(groups):
        group.env = "a" if (chunk + i // 3) % 2 else "b"
        group.env_id = None if group.env == "b" else chunk % 2
        group.policy_version = chunk // 4
        if chunk % 3 == 0 and i >= 4:  # a bigger group at the end of some shards
            group.tokens, group.masks = group.tokens * 2, group.masks * 2
            group.scores, group.inference_logprobs = group.scores * 2, group.inference_logprobs * 2
            group.messages = group.messages * 2
    return groups


def build(root, shards: int = 12) -> ShardStore:
    store = ShardStore(root)
    for chunk in range(shards):  # two producers, interleaved
        store.commit(RUN, f"w{chunk % 2}", chunk, groups_of(chunk))
    return store


def strip(root, keep: set[int] = frozenset()) -> None:
    """Rewrite the run's log as a store of before wrote it: lines without "index" (but those at `keep`)."""
    store = ShardStore(root)
    log = store.commit_log(RUN)
    lines = log.read_bytes().splitlines()
    log.write_bytes(b"".join(
        line + b"\n" if at in keep else encode_line({k: v for k, v in decode_line(line).items() if k not in ("index", "check")})
        for at, line in enumerate(lines)))
    store.manifest_path(RUN).unlink(missing_ok=True)


def file_index(store: ShardStore, shard: str) -> pa.Table:
    return follower.read_index(store.shards_dir(RUN) / shard)


def test_commit_writes_its_rows_as_runs_and_readers_get_them_back(tmp_path):
    store = build(tmp_path)
    records = list(ShardStore(tmp_path).committed(RUN).values())
    assert len(records) == 12
    for record in records:
        assert record.index is not None and len(record.index["runs"]) >= 2
        assert plain(table_of(record.index)).equals(file_index(store, record.shard).cast(plain(table_of(record.index)).schema))
    # the Arrow path (run-api's ingest commits record batches)
    batch = groups_to_record_batch(groups_of(20))
    arrow = store.commit(RUN, "ingest", 0, batch)
    assert arrow.index == summarize_rows(*(batch.column(name).to_pylist() for name in INDEX_COLUMNS))
    assert plain(table_of(arrow.index)).equals(file_index(store, arrow.shard).cast(plain(table_of(arrow.index)).schema))
    # from the manifest: the same summaries, one object per distinct summary
    reader = ShardStore(tmp_path)
    assert save_manifest(reader.manifest_path(RUN), reader._read_log(RUN))
    loaded = ShardStore(tmp_path).committed(RUN)
    assert {name: r.index for name, r in loaded.items()} == {name: r.index for name, r in reader.committed(RUN).items()}
    same = ShardStore(tmp_path)
    for chunk in range(3):
        same.commit(RUN, "same", chunk, list(synthetic_groups(4, start=1000 + 4 * chunk, group_size=2, seq_len=8)))
    save_manifest(same.manifest_path(RUN), same._read_log(RUN))
    alike = [r.index for name, r in ShardStore(tmp_path).committed(RUN).items() if name.startswith("same-")]
    assert len(alike) == 3 and alike[0] is alike[1] is alike[2]


def test_rows_that_change_too_often_are_not_summarized(tmp_path):
    groups = list(synthetic_groups(70, group_size=2, seq_len=8))
    for i, group in enumerate(groups):
        group.env = "a" if i % 2 else "b"
    record = ShardStore(tmp_path).commit(RUN, "w0", 0, groups)
    assert record.index is None  # more than SHARD_MAX_RUNS runs: the file is read, as before
    assert b'"index"' not in ShardStore(tmp_path).commit_log(RUN).read_bytes()


@pytest.mark.parametrize("damage", ["rows", "code", "shape"])
def test_a_summary_that_does_not_add_up_is_not_trusted(tmp_path, damage):
    """The summary is kept only where it is well formed and its runs add up to the record's rows (the rest of the
    checksummed line); otherwise the shard is read from its file, as a record of before is."""
    store = build(tmp_path, 2)
    log = store.commit_log(RUN)
    lines = log.read_bytes().splitlines()
    data = decode_line(lines[1])
    data.pop("check", None)
    if damage == "rows":
        data["index"]["runs"][0][4] += 1
    elif damage == "code":
        data["index"]["runs"][0][0] = 7
    else:
        data["index"] = {"env": "a", "runs": 3}
    log.write_bytes(lines[0] + b"\n" + encode_line(data))
    store = ShardStore(tmp_path)
    assert store.record(RUN, "w0-00000000.parquet").index is not None
    assert store.record(RUN, "w1-00000001.parquet").index is None
    found = follower.scan_new_shards(store, [RUN], set(), set())
    assert [s.index_offset for s in found] == [0, None]  # the second one's index was read from its file
    assert plain(found[1].index).equals(file_index(store, "w1-00000001.parquet").cast(plain(found[1].index).schema))
    # nor from a manifest whose row's summary does not add up to its rows
    reader = ShardStore(tmp_path)
    log_state = reader._read_log(RUN)
    bad = log_state.records["w0-00000000.parquet"]
    bad.__dict__["index"] = {"env": ["a"], "runs": [[0, None, 0, 2, bad.rows + 1]]}
    assert save_manifest(reader.manifest_path(RUN), log_state)
    assert ShardStore(tmp_path).record(RUN, "w0-00000000.parquet").index is None


def test_many_summaries_make_one_table():
    one = {"env": ["x"], "runs": [[0, None, 3, 4, 2]]}
    two = {"env": ["y", "x"], "runs": [[0, 5, 1, 2, 1], [1, None, 1, 8, 2]]}
    empty = {"env": [], "runs": []}
    made = table_of_many([one, two, empty, one, two])
    expected = pa.concat_tables([plain(table_of(s)) for s in (one, two, empty, one, two)])
    assert plain(made).equals(expected)
    assert plain(table_of_many([one, one])).equals(pa.concat_tables([plain(table_of(one))] * 2))


def serve_life(root, state, taken: int = 0) -> tuple[int, str]:
    """A run-api start-up: (groups queued, digest of every lane's queue); `taken`: mark the first groups of the
    served state's sources taken first (as a served life leaves them), then start again."""

    async def life() -> tuple[int, str]:
        service = BatchService(ServeConfig(store_root=str(root), follow_interval_s=3600, follow_runs=[RUN],
                                           state_path=str(state)))
        await service.start()
        result = service.queue.groups, queue_digest(service.queue)
        await service.stop()
        return result

    result = asyncio.run(life())
    if taken:
        db = sqlite3.connect(state)
        with db:
            db.executemany("INSERT OR REPLACE INTO taken (source, row, step, pos, epoch) VALUES (?, ?, ?, ?, 0)",
                           ((1 + i // 3 * 2, i % 3, 0, i) for i in range(taken)))
        db.close()
        result = asyncio.run(life())
    return result


@pytest.mark.parametrize("list_at", [2, 1000])
def test_start_ups_with_summaries_open_no_shard_and_queue_what_reading_queues(tmp_path, monkeypatch, list_at):
    """Same groups in the same order, lane by lane, fresh and restarted (with taken rows), whether the records carry
    summaries (no index column read; presence by a stat each, or by one listing past LIST_AT) or not (read), or
    only some do."""
    monkeypatch.setattr(follower, "LIST_AT", list_at)
    build(tmp_path / "new")
    shutil.copytree(tmp_path / "new", tmp_path / "old")
    shutil.copytree(tmp_path / "new", tmp_path / "mixed")
    strip(tmp_path / "old")
    strip(tmp_path / "mixed", keep={0, 1, 5, 6, 7, 11})
    expected = {taken: serve_life(tmp_path / "old", tmp_path / f"old-{taken}.db", taken) for taken in (0, 7)}
    assert expected[0][0] == 72 and expected[7][0] == 72 - 7
    assert serve_life(tmp_path / "mixed", tmp_path / "mixed.db", 7) == expected[7]
    reads = []
    real = follower.read_index

    def counted(path, filesystem=None):
        reads.append(path)
        return real(path, filesystem)

    monkeypatch.setattr(follower, "read_index", counted)
    for taken in (0, 7):
        assert serve_life(tmp_path / "new", tmp_path / f"new-{taken}.db", taken) == expected[taken]
    assert reads == []


def test_a_commit_cut_short_before_its_rename_is_finished_and_a_missing_shard_is_left_out(tmp_path, monkeypatch):
    """Presence from the listing: a logged shard still under its temporary name (a crash between the log append and
    the rename) is renamed into place by the scan (`finish_commits`) and served; one that is gone is reported and
    left out, as before."""
    monkeypatch.setattr(follower, "LIST_AT", 1)
    store = build(tmp_path, 6)
    shards = store.shards_dir(RUN)
    (shards / "w1-00000003.parquet").rename(shards / ".w1-00000003.parquet.0123456789ab.tmp")
    (shards / "w0-00000004.parquet").unlink()
    reported: set[str] = set()
    found = follower.scan_new_shards(ShardStore(tmp_path), [RUN], set(), reported)
    assert [s.shard for s in found] == [f"w{c % 2}-0000000{c}.parquet" for c in (0, 1, 2, 3, 5)]
    assert (shards / "w1-00000003.parquet").exists()
    assert reported == {str(shards / "w0-00000004.parquet")}
    for shard in found:
        assert plain(shard.index).equals(file_index(store, shard.shard).cast(plain(shard.index).schema))


def test_a_compacted_shard_uses_the_merged_file_not_its_own_summary(tmp_path):
    from factory.store_compact import compact_run

    store = build(tmp_path, 4)
    compact_run(store, RUN, target_bytes=1 << 30)
    records = ShardStore(tmp_path).committed(RUN)
    assert all(r.file and r.index is None for r in records.values())
    found = follower.scan_new_shards(ShardStore(tmp_path), [RUN], set(), set())
    assert sum(s.rows for s in found) == 24 and all(s.index_offset is None for s in found if hasattr(s, "index_offset"))


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_damaged_shard_whose_record_has_a_summary_is_left_out_when_read_and_the_rest_served(tmp_path, prefetch):
    """The scan does not open it, so a shard damaged in place (same size) is found when a batch reads it: its groups
    leave the queue unserved (not recorded as served, so a restart tries them again) and the batch is formed
    again without them. Every other group is served once."""
    import orjson

    store = ShardStore(tmp_path)
    groups = list(synthetic_groups(30, group_size=2, seq_len=8, env="e"))
    for chunk in range(3):
        store.commit(RUN, "w0", chunk, groups[chunk * 10:(chunk + 1) * 10])
    path = store.shards_dir(RUN) / "w0-00000001.parquet"
    data = path.read_bytes()
    path.write_bytes(b"x" * len(data))
    registration = dict(wandb_group="g", wandb_project="p", batch_size=8, max_token_len=64, checkpoint_dir="ckpt",
                        save_checkpoint_interval=0, starting_step=0, num_steps=1000)
    cfg = ServeConfig(store_root=str(tmp_path), follow_interval_s=3600, follow_runs=[RUN], batch_metadata=True,
                      state_path=str(tmp_path / "state.db"), prefetch=prefetch)

    async def life(queued: int) -> list[str]:
        service = BatchService(cfg)
        await service.start()
        assert service.queue.groups == queued  # from the summaries: the damage is not seen yet
        if service.registration is None:
            await service.register(registration)
        served: list[str] = []
        for _ in range(20):
            body = orjson.loads((await service.next_batch(False)).raw)
            if not body.get("batch"):
                break
            served += [item["group_id"] for item in body["batch"]]
        await service.stop()
        return served

    served = asyncio.run(life(30))
    assert sorted(served) == sorted(g.group_id for g in groups[:10] + groups[20:])
    path.write_bytes(data)  # repaired: a restart queues the groups left out, and serves them
    again = asyncio.run(life(10))  # 8 of them: the last 2 groups (4 sequences) do not fill a batch of 8
    assert len(again) == len(set(again)) == 8 and set(again) <= {g.group_id for g in groups[10:20]}


def test_a_shard_gone_after_it_was_queued_fails_the_batch_and_leaves_its_groups_queued(tmp_path):
    """Gone, not damaged (e.g. a compaction removed it before this service's next scan moved its rows): the batch
    fails as before (the trainer retries it), and nothing leaves the queue."""
    from factory.serve.contract import PayloadError

    store = ShardStore(tmp_path)
    for chunk in range(2):
        store.commit(RUN, "w0", chunk, list(synthetic_groups(4, start=4 * chunk, group_size=2, seq_len=8, env="e")))
    registration = dict(wandb_group="g", wandb_project="p", batch_size=16, max_token_len=64, checkpoint_dir="ckpt",
                        save_checkpoint_interval=0, starting_step=0, num_steps=1000)
    cfg = ServeConfig(store_root=str(tmp_path), follow_interval_s=3600, follow_runs=[RUN], prefetch=False,
                      state_path=str(tmp_path / "state.db"))

    async def life() -> int:
        service = BatchService(cfg)
        await service.start()
        await service.register(registration)
        (store.shards_dir(RUN) / "w0-00000001.parquet").unlink()
        with pytest.raises(PayloadError):
            await service.next_batch(False)
        groups = service.queue.groups
        await service.stop()
        return groups

    assert asyncio.run(life()) == 8


def test_the_change_list_of_a_log_loaded_from_its_manifest_is_its_records_once_each(tmp_path):
    """A start-up's first scan takes a manifest-loaded log's records as they are (no dedupe); after more commits and
    a re-commit, changes are still each shard once, in change order; `compacted` says whether the run has a logged
    compaction (run-api's restart skips looking up every source's file when none has)."""
    from factory.store_compact import compact_run

    store = build(tmp_path, 6)
    assert save_manifest(store.manifest_path(RUN), store._read_log(RUN))
    fresh = ShardStore(tmp_path)
    cursor, items = fresh.changed_items(RUN)
    assert [r.shard for r in items] == [f"w{c % 2}-0000000{c}.parquet" for c in range(6)]
    assert not fresh.compacted(RUN)
    store.commit(RUN, "w0", 6, groups_of(6))
    store.commit(RUN, "w0", 0, groups_of(0), replace=True)
    again = ShardStore(tmp_path)
    _, items = again.changed_items(RUN)
    assert [r.shard for r in items] == [f"w{c % 2}-0000000{c}.parquet" for c in (1, 2, 3, 4, 5, 6, 0)]
    assert [r.shard for r in fresh.changed_items(RUN, cursor)[1]] == ["w0-00000006.parquet", "w0-00000000.parquet"]
    compact_run(store, RUN, target_bytes=1 << 30)
    assert ShardStore(tmp_path).compacted(RUN)
