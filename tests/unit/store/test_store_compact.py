"""Compaction and the run manifest: same groups, same (shard, row) keys, crash-safe at every step."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from factory.serve.config import ServeConfig
from factory.serve.service import BatchService
from factory.store import MANIFEST_NAME, ShardStore, StoreError
from factory.store_compact import compact_run, plan
from factory.synthetic import synthetic_groups

REGISTRATION = dict(
    wandb_group="g", wandb_project="p", batch_size=8, max_token_len=64,
    checkpoint_dir="ckpt", save_checkpoint_interval=5, starting_step=0, num_steps=1000,
)
REPO = Path(__file__).resolve().parents[3]


def fill(store: ShardStore, run: str, shards: int, per: int = 5, producer: str = "w0", start: int = 0) -> None:
    for chunk in range(start, start + shards):
        store.commit(run, producer, chunk, synthetic_groups(per, start=chunk * per, group_size=2, seq_len=8))


def ids(store: ShardStore, run: str) -> list[str]:
    return [g.group_id for g in store.iter_groups(run)]


def glob_ids(root: Path, run: str) -> list[str]:
    found = []
    for path in sorted((root / run / "shards").glob("*.parquet")):
        found += pq.read_table(path, columns=["group_id"]).column(0).to_pylist()
    return found


def test_compaction_keeps_every_group_in_order_and_each_shard_locatable(tmp_path):
    store = ShardStore(tmp_path)
    fill(store, "r", 30)
    before, records = ids(store, "r"), store.committed("r")
    report = compact_run(store, "r", target_bytes=sum(r.bytes for r in records.values()) // 3, copy=True)
    assert report.copied == len(report.files) and not report.decoded  # row groups copied, not re-encoded
    assert report.shards >= 28 and len(report.files) >= 3 and report.rows == 5 * report.shards  # a last lone shard stays
    fresh = ShardStore(tmp_path)
    assert ids(fresh, "r") == before
    assert sorted(glob_ids(tmp_path, "r")) == sorted(before)  # glob readers: each group once, old files gone
    assert fresh.verify("r") == []
    assert fresh.count("r") == 150 and fresh.is_committed("r", "w0", 29)
    for name, record in records.items():  # a shard's rows are where locate says
        path, offset, rows = fresh.locate("r", name)
        table = pq.read_table(path, columns=["group_id"]).slice(offset, rows)
        assert table.column(0).to_pylist() == before[record.chunk * 5 : record.chunk * 5 + 5]
    # A resumed writer still skips committed chunks; new chunks commit beside the compacted files.
    assert fresh.commit("r", "w0", 3, synthetic_groups(5, start=999)).skipped
    fill(fresh, "r", 2, start=30)
    assert len(ids(ShardStore(tmp_path), "r")) == 160


def test_a_shard_replaced_after_compaction_is_read_once_from_its_new_file(tmp_path):
    store = ShardStore(tmp_path)
    fill(store, "r", 6)
    compact_run(store, "r", target_bytes=1 << 30)
    store.commit("r", "w0", 2, synthetic_groups(5, start=500, group_size=2, seq_len=8), replace=True)
    got = ids(ShardStore(tmp_path), "r")
    assert len(got) == 30 and len(set(got)) == 30
    assert {g.group_id for g in synthetic_groups(5, start=500, group_size=2, seq_len=8)} <= set(got)


def test_plan_leaves_a_small_last_batch_unless_flushed():
    from factory.store import CommitRecord

    records = [CommitRecord(f"w-{i}.parquet", "r", "w", i, 1, 100, "x", "t") for i in range(10)]
    assert [len(b) for b in plan(records, 300, flush=False)] == [3, 3, 3]
    assert [len(b) for b in plan(records, 300, flush=True)] == [3, 3, 3]  # a batch of one is not merged
    assert [len(b) for b in plan(records[:8], 300, flush=True)] == [3, 3, 2]


def test_manifest_gives_a_new_process_the_same_state_and_only_the_log_after_it_is_parsed(tmp_path, monkeypatch):
    monkeypatch.setattr("factory.store.MANIFEST_EVERY_LINES", 10)
    store = ShardStore(tmp_path)
    fill(store, "r", 12)
    compact_run(store, "r", target_bytes=1 << 30)
    fill(store, "r", 25, start=12)
    assert (tmp_path / "r" / MANIFEST_NAME).is_file()
    expected = store.committed("r")
    fresh = ShardStore(tmp_path)
    parsed = []
    original = ShardStore._parse_line
    monkeypatch.setattr(ShardStore, "_parse_line", staticmethod(lambda *a: (parsed.append(1), original(*a))[1]))
    assert fresh.committed("r") == expected
    assert 0 < len(parsed) < 25
    assert ids(fresh, "r") == ids(ShardStore(tmp_path), "r")


def test_a_manifest_that_no_longer_matches_the_log_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setattr("factory.store.MANIFEST_EVERY_LINES", 5)
    store = ShardStore(tmp_path)
    fill(store, "r", 12)
    log = store.commit_log("r")
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(b"".join(lines[:3]))  # the log rewritten shorter (e.g. by repair): the manifest is ahead of it
    assert len(ShardStore(tmp_path).committed("r")) == 3
    (tmp_path / "r" / MANIFEST_NAME).write_bytes(b"garbage")
    assert len(ShardStore(tmp_path).committed("r")) == 3


def test_compaction_refuses_a_run_an_old_version_still_writes(tmp_path):
    store = ShardStore(tmp_path)
    fill(store, "r", 3)
    with open(store.commit_log("r"), "ab") as log:
        log.write(store.committed("r")["w0-00000000.parquet"].to_json().encode() + b"\n")
    with pytest.raises(StoreError, match="older factory version"):
        compact_run(store, "r")
    assert len(ids(ShardStore(tmp_path), "r")) == 15


@pytest.mark.parametrize("copy", ["row_groups", "pages", "decode"])
def test_served_groups_stay_served_after_compaction_and_restart(tmp_path, copy):
    def batch_ids(body: bytes) -> list[str]:
        data = orjson.loads(body)
        return [item["group_id"] for item in data["batch"]] if data.get("batch") else []

    async def scenario():
        store = ShardStore(tmp_path)
        fill(store, "gen", 20, per=4)
        cfg = ServeConfig(store_root=str(tmp_path), follow_interval_s=0.05, follow_runs=["gen"], batch_metadata=True)
        service = BatchService(cfg)
        await service.start()
        await service.register(REGISTRATION)
        served = []
        for _ in range(4):
            served += batch_ids((await service.next_batch(False)).raw)
        await service.stop()
        compact_run(ShardStore(tmp_path), "gen", target_bytes=1 << 30, method=copy)
        assert len(list((tmp_path / "gen" / "shards").glob("*.parquet"))) == 1
        service = BatchService(cfg)
        await service.start()
        while got := batch_ids((await service.next_batch(False)).raw):
            served += got
        fill(ShardStore(tmp_path), "gen", 2, per=4, start=20)  # followed after the restart, beside the merged file
        for _ in range(100):
            await asyncio.sleep(0.05)
            if got := batch_ids((await service.next_batch(False)).raw):
                served += got
            if len(served) >= 88:
                break
        await service.stop()
        return served

    served = asyncio.run(scenario())
    expected = [g.group_id for g in synthetic_groups(88, group_size=2, seq_len=8)]
    assert len(served) == len(set(served)) == 88 and set(served) == set(expected)


KILL_POINTS = ["written", "logged", "renamed", "removing"]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("copy", ["row_groups", "pages", "decode"])
@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_9_at_any_step_of_a_compaction_leaves_the_store_consistent(tmp_path, point, copy, workers):
    store = ShardStore(tmp_path)
    fill(store, "r", 8)
    before = ids(store, "r")
    # with workers: three batches, the later ones written by the workers while the first is committed
    target = 1 << 30 if workers == 1 else sum(r.bytes for r in store.committed("r").values()) // 3
    child = textwrap.dedent(f"""
        import os, signal
        import factory.store_compact as compact
        from factory.store import ShardStore
        def die(point):
            if point == {point!r}:
                os.kill(os.getpid(), signal.SIGKILL)
        compact._reached = die
        compact.PARALLEL_MIN_BYTES = 0
        compact.compact_run(ShardStore({str(tmp_path)!r}), "r", target_bytes={target}, method={copy!r},
                            workers={workers})
    """)
    result = subprocess.run([sys.executable, "-c", child], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            capture_output=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    fresh = ShardStore(tmp_path)
    assert ids(fresh, "r") == before  # store readers: every committed group, once, in order
    fresh.commit("r", "w0", 8, synthetic_groups(5, start=40, group_size=2, seq_len=8))  # finishes a logged compaction
    assert sorted(glob_ids(tmp_path, "r")) == sorted(before + [g.group_id for g in synthetic_groups(5, start=40, group_size=2, seq_len=8)])
    assert [p.kind for p in fresh.verify("r")] == []
    compact_run(fresh, "r", target_bytes=1 << 30)  # and compacting again completes the job
    assert ids(ShardStore(tmp_path), "r") == ids(fresh, "r") and len(ids(fresh, "r")) == 45


@pytest.mark.parametrize("copy", ["row_groups", "pages", "decode"])
def test_full_disk_during_compaction_leaves_every_group_readable(tmp_path, monkeypatch, copy):
    store = ShardStore(tmp_path)
    fill(store, "r", 5)
    before = ids(store, "r")
    import errno

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = {"row_groups": "_write_concatenated", "pages": "_write_pages", "decode": "_write_merged"}[copy]
    monkeypatch.setattr(f"factory.store_compact.{writer}", full)
    with pytest.raises(StoreError, match="disk is full"):
        compact_run(store, "r", method=copy)
    assert ids(ShardStore(tmp_path), "r") == before
    assert not [p for p in (tmp_path / "r" / "shards").iterdir() if p.name.endswith(".tmp")]


def test_compact_task_function_and_cli(tmp_path, capsys):
    from factory.store_cli import main as store_cli
    from tasks.compact import compact_one_run

    store = ShardStore(tmp_path)
    fill(store, "a", 4)
    fill(store, "b", 4)
    report = compact_one_run(str(tmp_path), "a", target_bytes=1 << 30, flush=True)
    assert report["shards"] == 4 and report["rows"] == 20 and "merged 4 shards" in report["summary"]
    assert store_cli(["compact", str(tmp_path), "b", "--flush"]) == 0
    assert store_cli(["compact", str(tmp_path), "nope"]) == 1
    assert store_cli(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "b: merged 4 shards" in out and "nope: no commit log" in out
    assert len(list((tmp_path / "b" / "shards").glob("*.parquet"))) == 1


@pytest.mark.parametrize("copy", ["row_groups", "pages", "decode"])
def test_viewer_index_reads_the_same_rows_before_and_after_compaction(tmp_path, copy):
    from factory.viewer.index import RunIndex

    store = ShardStore(tmp_path)
    fill(store, "r", 6)
    index = RunIndex(store, "r")
    index.refresh()

    def rows(ix: RunIndex) -> dict[str, str]:
        frame = ix.frame if not callable(ix.frame) else ix.frame()
        payload = ix.read_rows(frame, ["group_id", "item_key"])
        return {row["group_id"]: row["item_key"] for row in payload}

    before = rows(index)
    # Copied: a row group per shard; pages: two shards per row group; decoded: shards straddle row groups.
    report = compact_run(store, "r", target_bytes=1 << 30, row_group_groups=7, method=copy)
    assert (report.copied, report.paged) == {"row_groups": (1, 0), "pages": (0, 1), "decode": (0, 0)}[copy]
    index.refresh()  # live: the compaction re-indexes its shards from the merged file
    assert rows(index) == before and len(before) == 30 and not index.problems
    fresh = RunIndex(ShardStore(tmp_path), "r")
    fresh.refresh()
    assert rows(fresh) == before and not fresh.problems


def test_shards_that_cannot_be_copied_are_merged_by_decoding(tmp_path, monkeypatch, caplog):
    """A shard written with other schema metadata (as by another version) is refused by the copy; the merge
    falls back to decoding, logs why, and every group is still there once, in order."""
    import factory.store as store_module

    store = ShardStore(tmp_path)
    fill(store, "r", 3)
    monkeypatch.setattr(store_module, "GROUP_SCHEMA", store_module.GROUP_SCHEMA.with_metadata({b"factory.schema_version": b"0"}))
    fill(store, "r", 2, start=3)
    monkeypatch.undo()
    before = ids(store, "r")
    with caplog.at_level("WARNING", logger="factory.store_compact"):
        report = compact_run(store, "r", target_bytes=1 << 30, copy=True)
    assert report.copied == 0 and len(report.decoded) == 1 and "key-value metadata differs" in report.decoded[0]
    assert "by decoding them" in caplog.text
    fresh = ShardStore(tmp_path)
    assert ids(fresh, "r") == before and fresh.verify("r") == []


def test_a_copied_file_holds_each_shard_as_its_own_row_groups(tmp_path):
    store = ShardStore(tmp_path)
    for chunk, count in enumerate([3, 7, 1, 12]):
        store.commit("r", "w0", chunk, synthetic_groups(count, start=chunk * 100, group_size=2, seq_len=8), row_group_groups=5)
    before, records = ids(store, "r"), store.committed("r")
    assert compact_run(store, "r", target_bytes=1 << 30, copy_min_shard_bytes=1).copied == 1
    fresh = ShardStore(tmp_path)
    (path,) = fresh.shard_paths("r")
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [3, 5, 2, 1, 5, 5, 2]
    assert ids(fresh, "r") == before and fresh.verify("r") == []
    for name, record in records.items():
        located, offset, rows = fresh.locate("r", name)
        assert located == path and pq.read_table(path).slice(offset, rows).column("group_id").to_pylist() == \
            [g.group_id for g in synthetic_groups(record.rows, start=record.chunk * 100, group_size=2, seq_len=8)]


def test_small_shards_are_merged_page_by_page_and_large_ones_copied_by_default(tmp_path):
    store = ShardStore(tmp_path)
    fill(store, "r", 4)
    records = store.committed("r")
    mean = sum(r.bytes for r in records.values()) // len(records)
    fill(store, "s", 4)
    report = compact_run(store, "r", target_bytes=1 << 30, copy_min_shard_bytes=mean + 1)
    assert report.paged == 1 and not report.decoded and not report.copied
    assert compact_run(store, "s", target_bytes=1 << 30, copy_min_shard_bytes=mean - 1000).copied == 1
    assert ids(ShardStore(tmp_path), "r") == ids(ShardStore(tmp_path), "s")
    (path,) = ShardStore(tmp_path).shard_paths("r")
    assert pq.ParquetFile(path).metadata.num_row_groups == 1  # 20 groups: one row group, not one per shard


def test_shards_with_dictionary_pages_are_merged_by_decoding(tmp_path, monkeypatch, caplog):
    """Shards written before PARQUET_OPTIONS turned dictionaries off cannot be merged page by page: decoded."""
    import factory.store as store_module

    store = ShardStore(tmp_path)
    monkeypatch.setitem(store_module.PARQUET_OPTIONS, "use_dictionary", ["group_id", "run_id", "env"])
    fill(store, "r", 2)
    monkeypatch.undo()
    fill(store, "r", 2, start=2)
    before = ids(store, "r")
    with caplog.at_level("WARNING", logger="factory.store_compact"):
        report = compact_run(store, "r", target_bytes=1 << 30)
    assert report.paged == 0 and len(report.decoded) == 1 and "dictionary" in report.decoded[0]
    assert "their pages cannot be copied" in caplog.text
    fresh = ShardStore(tmp_path)
    assert ids(fresh, "r") == before and fresh.verify("r") == []


@pytest.mark.parametrize("where", ["pages", "footer"])
@pytest.mark.parametrize("threaded,method", [(True, "row_groups"), (False, "row_groups"), (True, "pages")])
def test_a_damaged_shard_is_found_by_the_copy_and_its_batch_left_as_it_was(tmp_path, monkeypatch, where, threaded, method):
    if threaded:  # checked on the second thread while being copied
        monkeypatch.setattr("factory.store_compact.PARALLEL_HASH_BYTES", 0)
    store = ShardStore(tmp_path)
    fill(store, "r", 4)
    path = tmp_path / "r" / "shards" / "w0-00000002.parquet"
    data = bytearray(path.read_bytes())
    data[100 if where == "pages" else len(data) - 40] ^= 0xFF  # same size, other bytes
    path.write_bytes(bytes(data))
    report = compact_run(store, "r", target_bytes=1 << 30, method=method)
    assert report.files == [] and "sha256 differs from the commit log (corrupt)" in report.skipped[0]
    assert not [p for p in (tmp_path / "r" / "shards").iterdir() if p.name.startswith(".")]
    assert len(list((tmp_path / "r" / "shards").glob("*.parquet"))) == 4


def test_a_running_service_reads_shards_compacted_under_it_from_the_merged_file(tmp_path):
    """No restart: once the follower has seen the compaction record, queued groups of the merged (and removed)
    shard files are read from the merged file; each group is served once, in order."""
    def batch_ids(body: bytes) -> list[str]:
        data = orjson.loads(body)
        return [item["group_id"] for item in data["batch"]] if data.get("batch") else []

    async def scenario():
        fill(ShardStore(tmp_path), "gen", 20, per=4)
        cfg = ServeConfig(store_root=str(tmp_path), follow_interval_s=0.05, follow_runs=["gen"], batch_metadata=True,
                          prefetch=False)
        service = BatchService(cfg)
        await service.start()
        await service.register(REGISTRATION)
        served = []
        for _ in range(3):
            served += batch_ids((await service.next_batch(False)).raw)
        await asyncio.to_thread(compact_run, ShardStore(tmp_path), "gen", target_bytes=1 << 30)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if len(service._moved) == 20:
                break
        while got := batch_ids((await service.next_batch(False)).raw):
            served += got
        await service.stop()
        return served

    served = asyncio.run(scenario())
    assert served == [g.group_id for g in synthetic_groups(80, group_size=2, seq_len=8)]


def test_members_are_removed_several_at_a_time_and_all_of_them(tmp_path, monkeypatch):
    monkeypatch.setattr("factory.store_compact.UNLINK_THREADS", 2)  # 9 members after the first: on 2 threads
    store = ShardStore(tmp_path)
    fill(store, "r", 10)
    before = ids(store, "r")
    report = compact_run(store, "r", target_bytes=1 << 30, method="pages")
    assert report.shards == 10 and len(report.files) == 1
    assert sorted(p.name for p in (tmp_path / "r" / "shards").iterdir()) == report.files
    fresh = ShardStore(tmp_path)
    assert ids(fresh, "r") == before and fresh.verify("r") == []


def test_a_compaction_that_moved_many_shards_rewrites_the_manifest(tmp_path, monkeypatch):
    """A few compaction lines move every shard: the first reader after them checkpoints the records as they stand,
    so the next process parses no compaction line (applying one per member cost seconds at 300k shards)."""
    monkeypatch.setattr("factory.store.MANIFEST_EVERY_LINES", 10)
    store = ShardStore(tmp_path)
    fill(store, "r", 40)
    ShardStore(tmp_path).committed("r")  # the manifest covers the 40 commits
    compact_run(ShardStore(tmp_path), "r", target_bytes=1 << 30)
    expected = ShardStore(tmp_path).committed("r")  # this reader parses the compaction line and saves a manifest
    assert {record.file for record in expected.values()} != {""}
    parsed = []
    original = ShardStore._parse_line
    monkeypatch.setattr(ShardStore, "_parse_line", staticmethod(lambda *a: (parsed.append(1), original(*a))[1]))
    fresh = ShardStore(tmp_path).committed("r")
    assert fresh == expected and parsed == []
    assert [r.row_offset for r in fresh.values()] == [5 * i for i in range(40)]


def test_a_compaction_saves_the_manifest_once_at_its_end_not_per_merged_file(tmp_path, monkeypatch):
    """Each compaction record moves many shards: the store's rule (a checkpoint after lines that moved a quarter of
    the records) would save the whole manifest every few merged files of one compaction; it is saved once."""
    import factory.store as store_module
    import factory.store_compact as compact_module

    monkeypatch.setattr(store_module, "MANIFEST_EVERY_LINES", 10)
    monkeypatch.setattr(compact_module, "MANIFEST_EVERY_LINES", 10)
    fill(ShardStore(tmp_path), "r", 40)
    ShardStore(tmp_path).committed("r")  # the manifest covers the 40 commits
    saved = []
    for module in (store_module, compact_module):
        original = module.save_manifest
        monkeypatch.setattr(module, "save_manifest", lambda *a, _original=original: (saved.append(1), _original(*a))[1])
    store = ShardStore(tmp_path)
    size = sum(r.bytes for r in store.committed("r").values())
    report = compact_run(store, "r", target_bytes=size // 4 + 1, method="pages")
    assert len(report.files) >= 4 and report.shards == 40
    assert saved == [1]
    parsed = []
    original_parse = ShardStore._parse_line
    monkeypatch.setattr(ShardStore, "_parse_line", staticmethod(lambda *a: (parsed.append(1), original_parse(*a))[1]))
    fresh = ShardStore(tmp_path)
    assert fresh.committed("r") == store.committed("r") and parsed == []  # the saved manifest covers every record
    assert ids(fresh, "r") == [g.group_id for g in synthetic_groups(200, group_size=2, seq_len=8)]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files in /proc")
def test_members_are_read_ahead_in_order_and_leaving_early_closes_everything(tmp_path):
    from factory.store_compact import _Members, _read_member

    store = ShardStore(tmp_path)
    fill(store, "r", 12)
    batch = list(store.committed("r").values())
    directory = str(tmp_path / "r" / "shards")
    (tmp_path / "r" / "shards" / batch[5].shard).unlink()
    opened = _open_fds()
    seen = []
    with _Members(directory, batch, ahead_bytes=3 * batch[0].bytes) as members:  # a few members ahead at a time
        for record, path, fd in members:
            if fd is None:
                seen.append(None)
                continue
            try:
                data = _read_member(fd, record.bytes)
            finally:
                os.close(fd)
            assert data == Path(path).read_bytes() and path.endswith(record.shard)
            seen.append(record.shard)
    assert seen == [r.shard if i != 5 else None for i, r in enumerate(batch)]
    assert members.thread is None and _open_fds() == opened
    with _Members(directory, batch) as members:
        for _record, _path, fd in members:
            os.close(fd)
            break
    assert members.thread is None and _open_fds() == opened


@pytest.mark.parametrize("method", ["row_groups", "pages"])
def test_an_error_of_the_background_write_back_fails_the_merge(tmp_path, monkeypatch, method):
    """Linux reports a write-back error to one fsync of a file description: the one on the second thread must fail
    the merge (the final fsync would not see it again)."""
    import errno

    monkeypatch.setattr("factory.store_compact.WRITE_BACK_BYTES", 1)
    store = ShardStore(tmp_path)
    fill(store, "r", 6)
    before = ids(store, "r")

    def failing(_fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(StoreError, match="Input/output error"):
        compact_run(store, "r", target_bytes=1 << 30, method=method)
    monkeypatch.undo()
    assert ids(ShardStore(tmp_path), "r") == before
    assert not [p for p in (tmp_path / "r" / "shards").iterdir() if p.name.startswith(".")]


def test_a_compaction_leaves_the_garbage_collector_as_it_found_it(tmp_path):
    import gc

    store = ShardStore(tmp_path)
    fill(store, "r", 4)
    assert gc.isenabled()
    compact_run(store, "r", target_bytes=1 << 30)
    assert gc.isenabled()
    fill(store, "r", 4, start=4)
    gc.disable()
    try:
        compact_run(store, "r", target_bytes=1 << 30)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("method", ["row_groups", "pages"])
@pytest.mark.parametrize("change", ["truncated", "longer"])
def test_a_member_of_another_size_is_found_and_its_batch_left_as_it_was(tmp_path, method, change):
    """A longer file whose first bytes are the committed ones has the committed sha256 over those bytes: its size
    must be checked too (one byte more than the record is read)."""
    store = ShardStore(tmp_path)
    fill(store, "r", 4)
    before = ids(store, "r")
    path = tmp_path / "r" / "shards" / "w0-00000002.parquet"
    data = path.read_bytes()
    path.write_bytes(data[:-10] if change == "truncated" else data + b"\0" * 10)
    report = compact_run(store, "r", target_bytes=1 << 30, method=method)
    size = len(data) - 10 if change == "truncated" else len(data) + 10
    assert report.files == [] and f"size is {size} bytes, commit log says {len(data)}" in report.skipped[0]
    assert len(list((tmp_path / "r" / "shards").glob("*.parquet"))) == 4
    path.write_bytes(data)
    assert ids(ShardStore(tmp_path), "r") == before


# ---- merged files written by worker processes (compact_run(workers=N)) ----


def _children_gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    """Whether every process in `pids` has ended (a zombie not reaped by its new parent counts as ended)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError):
                continue
            if state not in ("Z", "X"):
                alive.append(pid)
        if not alive:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def parallel(monkeypatch):
    """Worker processes even for the tests' tiny stores."""
    monkeypatch.setattr("factory.store_compact.PARALLEL_MIN_BYTES", 0)


@pytest.mark.parametrize("method", ["row_groups", "pages", "decode"])
def test_workers_commit_the_same_merges_in_plan_order_and_end_with_the_compaction(tmp_path, parallel, method):
    import multiprocessing

    others = set(multiprocessing.active_children())  # children of other tests (the shared scorer pool's workers)
    serial, parallel_root = tmp_path / "serial", tmp_path / "parallel"
    for root in (serial, parallel_root):
        fill(ShardStore(root), "r", 20)
    records = ShardStore(serial).committed("r")
    target = sum(r.bytes for r in records.values()) // 5
    before = ids(ShardStore(serial), "r")
    one = compact_run(ShardStore(serial), "r", target_bytes=target, method=method, workers=1)
    many = compact_run(ShardStore(parallel_root), "r", target_bytes=target, method=method, workers=3)
    assert set(multiprocessing.active_children()) - others == set()  # the workers stopped with the compaction
    assert len(many.files) == len(one.files) >= 4 and many.shards == one.shards == 20 and many.rows == one.rows
    assert (many.copied, many.paged, len(many.decoded)) == (one.copied, one.paged, len(one.decoded))
    fresh = ShardStore(parallel_root)
    assert ids(fresh, "r") == before and fresh.verify("r") == []
    assert not [p for p in (parallel_root / "r" / "shards").iterdir() if p.name.startswith(".")]
    # the records in plan order: each merged file's members follow the previous file's
    lines = [orjson.loads(line) for line in fresh.commit_log("r").read_bytes().splitlines()]
    members = [m[0] for line in lines if "compact" in line for m in line["members"]]
    assert members == sorted(records) and [line["compact"] for line in lines if "compact" in line] == many.files
    for name, record in records.items():
        path, offset, rows = fresh.locate("r", name)
        table = pq.read_table(path, columns=["group_id"]).slice(offset, rows)
        assert table.column(0).to_pylist() == before[record.chunk * 5 : record.chunk * 5 + 5]


def test_a_small_compaction_stays_in_one_process(tmp_path, monkeypatch):
    import factory.store_compact as compact

    def no_workers(*_args, **_kwargs):
        raise AssertionError("worker processes started for a small compaction")

    monkeypatch.setattr(compact, "_merge_in_workers", no_workers)
    store = ShardStore(tmp_path)
    fill(store, "r", 10)
    report = compact_run(store, "r", target_bytes=sum(r.bytes for r in store.committed("r").values()) // 3, workers=4)
    assert len(report.files) == 3
    assert 1 <= compact.default_workers() <= compact.MAX_DEFAULT_WORKERS


def _compact_with_two_workers(root: str, target: int) -> int:
    return len(compact_run(ShardStore(root), "r", target_bytes=target, workers=2).files)


def test_a_daemonic_process_compacts_in_itself(tmp_path, parallel):
    """multiprocessing's pool workers and Dask's worker processes are daemonic and may not start children: asked
    for workers there, the compaction merges in its own process instead of failing."""
    import multiprocessing

    store = ShardStore(tmp_path)
    fill(store, "r", 12)
    before = ids(store, "r")
    target = sum(r.bytes for r in store.committed("r").values()) // 3
    with multiprocessing.get_context("fork").Pool(1) as pool:  # its worker is daemonic
        assert pool.apply(_compact_with_two_workers, (str(tmp_path), target)) >= 3
    fresh = ShardStore(tmp_path)
    assert ids(fresh, "r") == before and fresh.verify("r") == []


@pytest.mark.parametrize("failure", ["disk full", "worker killed", "damaged member"])
def test_a_worker_failure_fails_its_batch_as_in_one_process(tmp_path, parallel, monkeypatch, failure):
    import errno
    import multiprocessing

    import factory.store_compact as compact

    others = set(multiprocessing.active_children())  # children of other tests (the shared scorer pool's workers)
    store = ShardStore(tmp_path)
    fill(store, "r", 12)
    before = ids(store, "r")
    target = sum(r.bytes for r in store.committed("r").values()) // 4
    if failure == "damaged member":
        path = tmp_path / "r" / "shards" / "w0-00000005.parquet"
        data = bytearray(path.read_bytes())
        data[100] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        real = compact._write_pages

        def failing(shards, tmp, batch, row_group_groups):  # runs in a worker (forked with this patch)
            if batch[0].shard == "w0-00000003.parquet":
                if failure == "worker killed":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(shards, tmp, batch, row_group_groups)

        monkeypatch.setattr(compact, "_write_pages", failing)
    if failure == "damaged member":
        report = compact_run(store, "r", target_bytes=target, method="pages", workers=2)
        assert "sha256 differs" in report.skipped[0] and report.shards == 9  # the other batches merged
    else:
        with pytest.raises(StoreError, match="disk is full" if failure == "disk full" else "worker process died") as error:
            compact_run(store, "r", target_bytes=target, method="pages", workers=2)
        if failure == "disk full":
            assert error.value.errno == errno.ENOSPC
    assert set(multiprocessing.active_children()) - others == set()
    assert not [p for p in (tmp_path / "r" / "shards").iterdir() if p.name.startswith(".")]
    fresh = ShardStore(tmp_path)
    if failure != "damaged member":
        assert ids(fresh, "r") == before and fresh.verify("r") == []
        committed = [len(r["members"]) for r in map(orjson.loads, fresh.commit_log("r").read_bytes().splitlines())
                     if "compact" in r]
        # the batch before the failing one, only (a dead worker breaks the pool: the first batch's result may be
        # lost with it, and the batch left as it was)
        assert committed == [3] or (failure == "worker killed" and committed == [])
        monkeypatch.undo()
        compact_run(fresh, "r", target_bytes=1 << 30, workers=2)
        assert ids(ShardStore(tmp_path), "r") == before


def test_kill_9_while_workers_hold_temporary_files(tmp_path):
    """The compaction killed while its workers write later batches: they die with it, their hidden temporary files
    are no part of the store (repair removes them), and the next compaction is right."""
    from factory.store_repair import repair

    store = ShardStore(tmp_path)
    fill(store, "r", 12)
    before = ids(store, "r")
    target = sum(r.bytes for r in store.committed("r").values()) // 4
    pids = tmp_path / "pids"
    child = textwrap.dedent(f"""
        import multiprocessing, os, signal, time
        import factory.store_compact as compact
        from factory.store import ShardStore
        real = compact._build
        def slow(directory, batch, *args):
            built = real(directory, batch, *args)
            if batch[0].shard != "w0-00000000.parquet":
                time.sleep(120)  # holding its finished temporary file
            return built
        def die(point):
            if point == "written":
                time.sleep(1)  # the workers are at their later batches
                with open({str(pids)!r}, "w") as out:
                    out.write(" ".join(str(p.pid) for p in multiprocessing.active_children()))
                os.kill(os.getpid(), signal.SIGKILL)
        compact._build, compact._reached, compact.PARALLEL_MIN_BYTES = slow, die, 0
        compact.compact_run(ShardStore({str(tmp_path)!r}), "r", target_bytes={target}, workers=2)
    """)
    result = subprocess.run([sys.executable, "-c", child], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            capture_output=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    workers = [int(pid) for pid in pids.read_text().split()]
    assert len(workers) == 2 and _children_gone(workers)
    shards = tmp_path / "r" / "shards"
    assert [p.name for p in shards.iterdir() if p.name.startswith(".compact-")]  # what the workers had written
    fresh = ShardStore(tmp_path)
    assert ids(fresh, "r") == before and fresh.verify("r") == [] and sorted(glob_ids(tmp_path, "r")) == sorted(before)
    assert compact_run(fresh, "r", target_bytes=1 << 30).shards == 12
    assert ids(ShardStore(tmp_path), "r") == before
    repair(ShardStore(tmp_path), "r", stale_tmp_s=0)
    assert not [p for p in shards.iterdir() if p.name.startswith(".compact-")]
