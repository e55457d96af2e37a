"""GroupCommitter and its write-ahead log: a chunk lingers for posts still being decoded (never for nobody, never past
linger_s); an answered post is durable in the log and becomes a shard behind; a crash loses nothing answered."""

from __future__ import annotations

import asyncio
import time

from factory.schema import groups_to_record_batch
import pyarrow.parquet as pq
import pytest

from factory.serve.ingest import GroupCommitter
from factory.serve.ingest_log import IngestLog, LogBusy
from factory.store import ShardStore
from factory.synthetic import synthetic_groups


def _rows(count: int, seed: int):
    return groups_to_record_batch(synthetic_groups(count, group_size=2, seq_len=8, seed=seed))


async def _committer(tmp_path, linger_s: float, **kwargs) -> tuple[GroupCommitter, list[int]]:
    chunk_sizes: list[int] = []
    log = IngestLog(ShardStore(tmp_path), "api", "api").open()
    committer = GroupCommitter(log, lambda shard, rows: chunk_sizes.append(rows.num_rows), lambda shard: None,
                               linger_s=linger_s, **kwargs)
    committer.start()
    return committer, chunk_sizes


def test_posts_being_decoded_share_one_shard(tmp_path):
    async def scenario() -> list[int]:
        committer, shards = await _committer(tmp_path, linger_s=5.0)

        async def post(seed: int, decode_s: float) -> None:
            with committer.arriving() as arrival:
                await asyncio.sleep(decode_s)  # the body is being decoded
                await committer.submit(_rows(1, seed), arrival)

        await asyncio.gather(post(1, 0.0), post(2, 0.05), post(3, 0.1))
        await committer.stop()
        return shards

    assert asyncio.run(scenario()) == [3]


def test_a_lone_post_does_not_wait_and_a_failed_decode_releases_the_commit(tmp_path):
    async def scenario() -> tuple[float, float, list[int]]:
        committer, shards = await _committer(tmp_path, linger_s=5.0)
        started = time.perf_counter()
        with committer.arriving() as arrival:
            await committer.submit(_rows(2, 1), arrival)
        lone = time.perf_counter() - started

        async def failing() -> None:
            try:
                with committer.arriving():
                    await asyncio.sleep(0.05)
                    raise ValueError("bad body")
            except ValueError:
                pass

        async def good() -> None:
            with committer.arriving() as arrival:
                await committer.submit(_rows(1, 2), arrival)

        started = time.perf_counter()
        await asyncio.gather(failing(), good())
        after_failure = time.perf_counter() - started
        await committer.stop()
        return lone, after_failure, shards

    lone, after_failure, shards = asyncio.run(scenario())
    assert lone < 1.0 and after_failure < 1.0  # nowhere near linger_s
    assert shards == [2, 1]


def test_linger_is_bounded(tmp_path):
    async def scenario() -> tuple[float, list[int]]:
        committer, shards = await _committer(tmp_path, linger_s=0.2)
        slow_done = asyncio.Event()

        async def slow() -> None:
            with committer.arriving() as arrival:
                await slow_done.wait()
                await committer.submit(_rows(1, 3), arrival)

        async def quick() -> float:
            started = time.perf_counter()
            with committer.arriving() as arrival:
                await committer.submit(_rows(1, 4), arrival)
            return time.perf_counter() - started

        slow_task = asyncio.create_task(slow())
        await asyncio.sleep(0)
        waited = await quick()
        slow_done.set()
        await slow_task
        await committer.stop()
        return waited, shards

    waited, shards = asyncio.run(scenario())
    assert 0.15 <= waited < 2.0
    assert shards == [1, 1]


def test_answered_posts_become_shards_and_leave_the_log(tmp_path):
    async def scenario() -> tuple[list[str], list[str]]:
        sharded: list[str] = []
        log = IngestLog(ShardStore(tmp_path), "api", "api").open()
        committer = GroupCommitter(log, lambda shard, rows: None, sharded.append)
        committer.start()
        for seed in range(3):
            await committer.submit(_rows(2, seed))
        await committer.stop()
        log.close()
        return sharded, log.chunks()

    sharded, left = asyncio.run(scenario())
    store = ShardStore(tmp_path)
    assert sharded == ["api-00000000.parquet", "api-00000001.parquet", "api-00000002.parquet"]
    assert sorted(store.committed("api")) == sharded and left == []
    assert sum(pq.read_metadata(path).num_rows for path in store.shard_paths("api")) == 6


def test_a_crash_after_the_answer_loses_nothing_and_adds_nothing_twice(tmp_path):
    store = ShardStore(tmp_path)
    log = IngestLog(store, "api", "api").open()
    first, second = _rows(2, 1), _rows(3, 2)
    log.write(0, first)
    store.commit("api", "api", 0, first)  # died after this shard, before deleting its chunk
    log.write(1, second)  # died before this shard
    (log.directory / ".000000000002.arrow.tmp").write_bytes(b"half a chunk")  # died while writing this one
    log.close()

    recovered = IngestLog(store, "api", "api").open()
    assert recovered.recover(row_group_groups=16) == 3
    committed = store.committed("api")
    assert sorted(committed) == ["api-00000000.parquet", "api-00000001.parquet"]
    assert [committed[name].rows for name in sorted(committed)] == [2, 3]
    assert recovered.chunks() == [] and not list(recovered.directory.glob(".*.tmp"))
    recovered.close()


def test_one_service_per_log(tmp_path):
    store = ShardStore(tmp_path)
    held = IngestLog(store, "api", "api").open()
    with pytest.raises(LogBusy, match="another ingest_producer"):
        IngestLog(store, "api", "api").open()
    IngestLog(store, "api", "other").open().close()
    held.close()
    IngestLog(store, "api", "api").open().close()


def test_chunks_wait_while_the_shard_backlog_is_full(tmp_path):
    async def scenario() -> int:
        committer, _ = await _committer(tmp_path, linger_s=0.0, backlog_bytes=1, max_groups=1)
        release = asyncio.Event()
        real_commit = committer.store.commit
        deepest = 0

        def slow_commit(*args, **kwargs):
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result()
            return real_commit(*args, **kwargs)

        loop = asyncio.get_running_loop()
        committer.store.commit = slow_commit
        posts = [asyncio.create_task(committer.submit(_rows(1, seed))) for seed in range(3)]
        for _ in range(50):
            await asyncio.sleep(0.01)
            deepest = max(deepest, len(committer._backlog))
        answered = sum(post.done() for post in posts)
        release.set()
        await asyncio.gather(*posts)
        await committer.stop()
        assert deepest == 1
        return answered

    assert asyncio.run(scenario()) == 1
