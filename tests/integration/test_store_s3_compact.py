"""Compaction of a run on an S3-compatible object store (a local moto server started and stopped by the test):
the same groups once, in order, before, during and after it; kill -9 at any step leaves the store consistent."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest

from factory.serve.config import ServeConfig
from factory.serve.service import BatchService
from factory.store_object import ObjectShardStore, open_store
from factory.store_object_compact import compact_object_run
from factory.synthetic import synthetic_groups
from tests.moto_s3 import bucket, s3_endpoint  # noqa: F401 - fixtures

REPO = Path(__file__).resolve().parents[2]
REGISTRATION = dict(
    wandb_group="g", wandb_project="p", batch_size=8, max_token_len=64,
    checkpoint_dir="ckpt", save_checkpoint_interval=5, starting_step=0, num_steps=1000,
)


def fill(store: ObjectShardStore, run: str, shards: int, per: int = 5, start: int = 0) -> None:
    for chunk in range(start, start + shards):
        store.commit(run, "w0", chunk, list(synthetic_groups(per, start=chunk * per, group_size=2, seq_len=8)))


def ids(url: str, run: str) -> list[str]:
    return [g.group_id for g in open_store(url).iter_groups(run)]


def keys(fs, prefix: str) -> list[str]:
    import pyarrow.fs as pafs

    return sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(prefix, allow_not_found=True)))


def test_compaction_keeps_every_group_once_in_order_and_writers_exactly_once(bucket):
    fs, name = bucket
    url = f"s3://{name}/s"
    fill(open_store(url), "r", 8)
    before = ids(url, "r")
    reader = open_store(url)  # a reader that listed the run before the compaction
    cursor, _ = reader.changes("r")
    report = compact_object_run(open_store(url), "r", target_bytes=1 << 30, keep_members_s=3600)
    assert report.shards == 8 and len(report.files) == 1 and report.rows == 40
    assert ids(url, "r") == before
    assert keys(fs, f"{name}/s/r/commits") == []  # the compaction record replaced the members' records
    assert len(keys(fs, f"{name}/s/r/shards")) == 9  # members kept for keep_members_s (readers that listed before)
    cursor, moved = reader.changes("r", cursor)
    assert len(moved) == 8 and all(r.file == report.files[0] for r in moved)
    assert [r.row_offset for r in moved] == [0, 5, 10, 15, 20, 25, 30, 35]
    # A retried chunk of a compacted shard stores nothing twice; new chunks go beside the merged object.
    writer = open_store(url)
    assert writer.commit("r", "w0", 3, list(synthetic_groups(5, start=15, group_size=2, seq_len=8))).skipped
    fill(writer, "r", 2, start=8)
    assert ids(url, "r") == before + [g.group_id for g in synthetic_groups(10, start=40, group_size=2, seq_len=8)]
    compact_object_run(open_store(url), "r", target_bytes=1 << 30, keep_members_s=0)  # finishes the first one too
    assert keys(fs, f"{name}/s/r/commits") == [] and len(keys(fs, f"{name}/s/r/shards")) == 2
    assert len(ids(url, "r")) == 50 == len(set(ids(url, "r")))


def test_served_groups_stay_served_after_an_object_store_compaction_and_restart(bucket, tmp_path):
    _, name = bucket
    url = f"s3://{name}/s"
    fill(open_store(url), "gen", 20, per=4)
    config = ServeConfig(store_root=url, state_path=str(tmp_path / "state.sqlite"), follow_runs=["gen"],
                         follow_interval_s=0.05, batch_metadata=True)

    def batch_ids(body: bytes) -> list[str]:
        data = orjson.loads(body)
        return [item["group_id"] for item in data["batch"]] if data.get("batch") else []

    async def scenario() -> list[str]:
        service = BatchService(config)
        await service.start()
        await service.register(REGISTRATION)
        served = []
        for _ in range(4):
            served += batch_ids((await service.next_batch(False)).raw)
        await service.stop()
        compact_object_run(open_store(url), "gen", target_bytes=1 << 30, keep_members_s=0)
        service = BatchService(config)
        await service.start()
        while got := batch_ids((await service.next_batch(False)).raw):
            served += got
        fill(open_store(url), "gen", 2, per=4, start=20)  # followed after the restart, beside the merged object
        for _ in range(100):
            await asyncio.sleep(0.05)
            served += batch_ids((await service.next_batch(False)).raw)
            if len(served) >= 88:
                break
        await service.stop()
        return served

    served = asyncio.run(scenario())
    assert len(served) == len(set(served)) == 88
    assert set(served) == {g.group_id for g in synthetic_groups(88, group_size=2, seq_len=8)}


@pytest.mark.parametrize("point", ["written", "logged", "removing"])
def test_kill_9_at_any_step_of_an_object_store_compaction_leaves_the_store_consistent(bucket, point):
    _, name = bucket
    url = f"s3://{name}/s"
    fill(open_store(url), "r", 8)
    before = ids(url, "r")
    child = textwrap.dedent(f"""
        import os, signal
        import factory.store_object_compact as compact
        from factory.store_object import open_store
        def die(point):
            if point == {point!r}:
                os.kill(os.getpid(), signal.SIGKILL)
        compact._reached = die
        compact.compact_object_run(open_store({url!r}), "r", target_bytes=1 << 30, keep_members_s=0)
    """)
    result = subprocess.run([sys.executable, "-c", child], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            capture_output=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    assert ids(url, "r") == before  # every committed group, once, in order
    writer = open_store(url)
    assert writer.commit("r", "w0", 2, list(synthetic_groups(5, start=10, group_size=2, seq_len=8))).skipped
    fill(writer, "r", 1, start=8)
    compact_object_run(open_store(url), "r", target_bytes=1 << 30, keep_members_s=0)  # compacting again completes it
    assert ids(url, "r") == before + [g.group_id for g in synthetic_groups(5, start=40, group_size=2, seq_len=8)]


def test_compact_task_flow_cli_on_an_object_store(bucket, capsys):
    from factory.store_cli import main as store_cli
    from tasks.compact import compact_one_run

    _, name = bucket
    url = f"s3://{name}/s"
    fill(open_store(url), "a", 4)
    fill(open_store(url), "b", 4)
    report = compact_one_run(url, "a", target_bytes=1 << 30, flush=True)
    assert report["shards"] == 4 and "merged 4 shards" in report["summary"]
    assert store_cli(["compact", url, "b", "--flush"]) == 0
    assert store_cli(["compact", url, "nope"]) == 1
    assert store_cli(["verify", url]) == 0  # after compaction: merged objects checked against their records
    assert store_cli(["repair", url]) == 2
    captured = capsys.readouterr()
    assert "b: merged 4 shards" in captured.out and "nope: no such run" in captured.out
    assert "a: 4 committed shards, 20 groups, consistent" in captured.out
    assert "verify and compact are available" in captured.err
    assert store_cli(["compact", "s3://no-such-bucket/s"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'no-such-bucket'" in err and "does not exist" in err
    assert len(ids(url, "a")) == len(ids(url, "b")) == 20


def test_run_api_keeps_serving_through_a_compaction_while_it_runs(bucket, tmp_path):
    """No restart: the follower sees the compaction record and reads the rest of the queued groups from the merged
    object (the member objects are deleted at once here, keep_members_s=0); each group is served once."""
    _, name = bucket
    url = f"s3://{name}/s"
    fill(open_store(url), "gen", 20, per=4)
    config = ServeConfig(store_root=url, state_path=str(tmp_path / "state.sqlite"), follow_runs=["gen"],
                         follow_interval_s=0.05, batch_metadata=True, prefetch=False)

    def batch_ids(body: bytes) -> list[str]:
        data = orjson.loads(body)
        return [item["group_id"] for item in data["batch"]] if data.get("batch") else []

    async def scenario() -> tuple[list[str], int]:
        service = BatchService(config)
        await service.start()
        await service.register(REGISTRATION)
        served = []
        for _ in range(3):
            served += batch_ids((await service.next_batch(False)).raw)
        await asyncio.to_thread(compact_object_run, open_store(url), "gen", target_bytes=1 << 30, keep_members_s=0)
        for _ in range(100):  # until the follower has moved every queued shard to the merged object
            await asyncio.sleep(0.05)
            if len(service._moved) == 20:
                break
        moved = len(service._moved)
        while got := batch_ids((await service.next_batch(False)).raw):
            served += got
        await service.stop()
        return served, moved

    served, moved = asyncio.run(scenario())
    assert moved == 20
    assert len(served) == len(set(served)) == 80
    assert served == [g.group_id for g in synthetic_groups(80, group_size=2, seq_len=8)]


def test_viewer_and_export_read_the_same_rows_after_an_object_store_compaction(bucket):
    from factory.viewer.index import RunIndex

    _, name = bucket
    url = f"s3://{name}/s"
    fill(open_store(url), "r", 8, per=4)

    def rows(index: RunIndex) -> dict[str, str]:
        payload = index.read_rows(index.frame, ["group_id", "item_key"])
        return {row["group_id"]: row["item_key"] for row in payload}

    viewer = RunIndex(open_store(url), "r")
    viewer.refresh()
    before, export_before = rows(viewer), ids(url, "r")
    compact_object_run(open_store(url), "r", target_bytes=1 << 30, row_group_groups=3, keep_members_s=0)
    viewer.refresh()  # live: the compaction re-indexes its shards from the merged object
    assert rows(viewer) == before and len(before) == 32 and not viewer.problems
    fresh = RunIndex(open_store(url), "r")
    fresh.refresh()
    assert rows(fresh) == before and not fresh.problems
    assert ids(url, "r") == export_before


@pytest.mark.parametrize("damaged", [1, 10])
def test_members_fetched_ahead_and_a_damaged_one_leaves_its_batch_as_it_was(bucket, monkeypatch, damaged):
    """Members are fetched several at a time, ahead of the merge; a member that does not match its record stops
    the batch (the GETs still in flight are waited for or dropped) and nothing is committed."""
    monkeypatch.setattr("factory.store_object_compact.GET_AHEAD", 3)
    monkeypatch.setattr("factory.store_object_compact.GET_THREADS", 2)
    fs, name = bucket
    url = f"s3://{name}/s"
    fill(open_store(url), "r", 12)
    before = ids(url, "r")
    store = open_store(url)
    record = store.committed("r")[sorted(store.committed("r"))[damaged]]
    path = store.shard_path("r", record.shard)
    with fs.open_input_stream(path) as handle:
        data = bytearray(handle.read())
    data[100] ^= 0xFF  # same size, other bytes
    with fs.open_output_stream(path) as out:
        out.write(bytes(data))
    report = compact_object_run(open_store(url), "r", target_bytes=1 << 30)
    assert report.files == [] and "does not match its record" in report.skipped[0]
    assert keys(fs, f"{name}/s/r/compactions") == [] and len(keys(fs, f"{name}/s/r/shards")) == 12
    data[100] ^= 0xFF
    with fs.open_output_stream(path) as out:  # the member restored: the next compaction merges the whole batch
        out.write(bytes(data))
    assert ids(url, "r") == before
    report = compact_object_run(open_store(url), "r", target_bytes=1 << 30)
    assert report.shards == 12 and ids(url, "r") == before
