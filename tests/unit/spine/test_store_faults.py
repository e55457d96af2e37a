"""ENOSPC and EIO at every write point of the store, then recovery and a rerun: nothing acknowledged is lost,
nothing is stored twice, and glob readers see exactly the committed groups."""

from __future__ import annotations

import errno

import polars as pl
import pytest

from bench.store_faults.inject import POINTS, Plan, inject
from factory.schema import groups_to_record_batch
from factory.store import ShardStore, StoreError
from factory.synthetic import synthetic_groups

CHUNKS = 4
PER_CHUNK = 3


def chunk_groups(chunk: int) -> list:
    return list(synthetic_groups(PER_CHUNK, start=PER_CHUNK * chunk, group_size=2, seq_len=8))


def attempt(store: ShardStore, chunk: int, acknowledged: dict[int, set[str]], errors: list[str]) -> None:
    try:
        store.commit("run", "w0", chunk, chunk_groups(chunk))
    except StoreError as error:
        errors.append(str(error))
        return
    acknowledged[chunk] = {g.group_id for g in chunk_groups(chunk)}


def check(store: ShardStore, acknowledged: dict[int, set[str]]) -> None:
    ids = [g.group_id for g in store.iter_groups("run")]
    assert len(ids) == len(set(ids)), "a group is stored twice"
    assert store.count("run") == len(ids)
    for chunk, expected in acknowledged.items():
        assert expected <= set(ids), f"acknowledged chunk {chunk} lost"
    globbed = pl.scan_parquet(str(store.shards_dir("run") / "*.parquet")).select("group_id").collect()["group_id"].to_list()
    assert sorted(globbed) == sorted(ids), "glob readers see other groups than the commit log"


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
@pytest.mark.parametrize("point", POINTS)
def test_a_failed_write_loses_and_duplicates_nothing(store_root, point, err):
    store = ShardStore(store_root)
    acknowledged: dict[int, set[str]] = {}
    errors: list[str] = []
    attempt(store, 0, acknowledged, errors)
    with inject(Plan(point, err)) as plan:
        if point == "run-file":
            with pytest.raises(StoreError, match=r"stats-w0\.json"):
                store.write_run_file("run", "stats-w0.json", "{}")
        else:
            attempt(store, 1, acknowledged, errors)
        attempt(store, 2, acknowledged, errors)
    assert plan.fired == 1
    if point in ("rename", "run-file"):
        assert not errors  # after the commit point (rename) or not a commit: every commit is acknowledged
    else:
        assert len(errors) == 1 and 1 not in acknowledged
        assert str(store_root) in errors[0], "the error names the path"
        if err == errno.ENOSPC:
            assert "disk is full" in errors[0] or "No space left" in errors[0]
    check(store, acknowledged)

    # Recovery: another process (a restart) reruns every chunk; committed ones are skipped, the rest filled in.
    rerun = ShardStore(store_root)
    for chunk in range(CHUNKS):
        attempt(rerun, chunk, acknowledged, errors)
    assert sorted(acknowledged) == list(range(CHUNKS))
    check(rerun, acknowledged)
    assert rerun.count("run") == CHUNKS * PER_CHUNK
    assert rerun.verify("run") == []
    leftovers = [p.name for p in store.run_dir("run").rglob("*.tmp")]
    # Only when taking back a torn record failed too is the temporary kept (it might have been committed).
    assert leftovers == [] if point != "log-undo" else len(leftovers) <= 1


def test_a_failed_rename_is_finished_by_the_next_reader_or_commit(store_root):
    store = ShardStore(store_root)
    with inject(Plan("rename")):
        record = store.commit("run", "w0", 0, chunk_groups(0))
    assert not record.skipped
    assert not (store.shards_dir("run") / record.shard).exists()  # durable in the log, not yet visible
    other = ShardStore(store_root)
    assert other.count("run") == PER_CHUNK
    assert [p.name for p in other.shard_paths("run")] == [record.shard]  # the reader renamed it into place
    assert other.verify("run") == []


def test_short_log_write_is_taken_back_and_the_next_commit_appends_cleanly(store_root):
    store = ShardStore(store_root)
    store.commit("run", "w0", 0, chunk_groups(0))
    size = store.commit_log("run").stat().st_size
    with inject(Plan(quota=10, quota_on=("log-write",))):  # the record's write is cut short by a full disk
        with pytest.raises(StoreError, match="commits.jsonl"):
            store.commit("run", "w0", 1, chunk_groups(1))
    assert store.commit_log("run").stat().st_size == size
    store.commit("run", "w0", 1, chunk_groups(1))
    assert store.count("run") == 2 * PER_CHUNK and store.verify("run") == []


def test_a_torn_tail_left_by_a_crash_is_cut_before_the_next_append(store_root):
    store = ShardStore(store_root)
    store.commit("run", "w0", 0, chunk_groups(0))
    good = store.commit_log("run").read_bytes()
    with open(store.commit_log("run"), "ab") as log:
        log.write(good[: len(good) // 2])  # a crash mid-append
    assert [p.kind for p in store.verify("run")] == ["torn-line"]
    store.commit("run", "w0", 1, chunk_groups(1))
    assert store.count("run") == 2 * PER_CHUNK
    assert ShardStore(store_root).verify("run") == []


@pytest.mark.parametrize("as_rows", [False, True], ids=["groups", "arrow-rows"])
def test_a_shard_and_its_directory_are_fsynced_together_before_its_record(store_root, monkeypatch, as_rows):
    """The shard's fsync and its directory's run at once (a barrier both must reach), and both end before the
    commit record is appended; a failed directory fsync fails the commit, which leaves nothing behind. Both write
    paths: validated groups (datagen workers) and Arrow rows (the run-api's ingest)."""
    import os
    import threading

    import factory.store as store_module

    both = threading.Barrier(2, timeout=5.0)
    order: list[str] = []
    real_fsync, real_dir, real_append = os.fsync, store_module.fsync_dir, store_module.append_line
    fail_dir = [False]

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            both.wait()
            real_fsync(fd)
            order.append("shard")
            return
        real_fsync(fd)

    def fsync_dir(path) -> None:
        if path.name == "shards":
            both.wait()
            if fail_dir[0]:
                raise OSError(errno.EIO, "injected", str(path))
            real_dir(path)
            order.append("dir")
            return
        real_dir(path)

    def append_line(path, line) -> None:
        order.append("record")
        real_append(path, line)

    monkeypatch.setattr(store_module.os, "fsync", fsync)
    monkeypatch.setattr(store_module, "fsync_dir", fsync_dir)
    monkeypatch.setattr(store_module, "append_line", append_line)
    def groups(chunk: int):
        return groups_to_record_batch(chunk_groups(chunk)) if as_rows else chunk_groups(chunk)

    store = ShardStore(store_root)
    store.commit("run", "w0", 0, groups(0))
    assert sorted(order[:2]) == ["dir", "shard"] and order[2:] == ["record"]
    fail_dir[0] = True
    with pytest.raises(StoreError, match="shards"):
        store.commit("run", "w0", 1, groups(1))
    assert order[3:] == ["shard"]  # the shard's fsync ended; no record was appended
    assert not list(store.shards_dir("run").glob("*.tmp"))
    assert set(store.committed("run")) == {store_module.shard_name("w0", 0)}
