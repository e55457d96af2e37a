"""GroupCommitter: a commit lingers for posts that are still being decoded, never for nobody, never past linger_s."""

from __future__ import annotations

import asyncio
import time

import pytest

from factory.schema import groups_to_record_batch
from factory.serve.ingest import GroupCommitter
from factory.store import ShardStore, shard_name
from factory.synthetic import synthetic_groups


def _rows(count: int, seed: int):
    return groups_to_record_batch(synthetic_groups(count, group_size=2, seq_len=8, seed=seed))


async def _committer(tmp_path, linger_s: float, linger_queued: bool = False) -> tuple[GroupCommitter, list[int]]:
    shard_sizes: list[int] = []
    committer = GroupCommitter(ShardStore(tmp_path), "api", "api", lambda record, rows: shard_sizes.append(rows.num_rows),
                               linger_s=linger_s, linger_queued=linger_queued)
    committer.start()
    return committer, shard_sizes


def test_posts_being_decoded_share_one_shard(tmp_path):
    async def scenario() -> list[int]:
        committer, shards = await _committer(tmp_path, linger_s=5.0)

        async def post(seed: int, decode_s: float) -> None:
            with committer.arriving() as arrival:
                committer.announce(arrival)
                await asyncio.sleep(decode_s)  # the body is being decoded
                await committer.submit(_rows(1, seed), arrival)

        await asyncio.gather(post(1, 0.0), post(2, 0.05), post(3, 0.1))
        await committer.stop()
        return shards

    assert asyncio.run(scenario()) == [3]


def test_posts_queued_for_a_decoder_share_one_shard_only_with_linger_queued(tmp_path):
    def shards_of(linger_queued: bool) -> list[int]:
        async def scenario() -> list[int]:
            committer, shards = await _committer(tmp_path / str(linger_queued), linger_s=5.0, linger_queued=linger_queued)

            async def post(seed: int, queued_s: float) -> None:
                with committer.arriving() as arrival:
                    await asyncio.sleep(queued_s)  # read, waiting for a decoder
                    committer.announce(arrival)  # a decoder took it: announced once only
                    await committer.submit(_rows(1, seed), arrival)

            await asyncio.gather(post(1, 0.0), post(2, 0.05), post(3, 0.1))
            await committer.stop()
            return shards

        return asyncio.run(scenario())

    assert shards_of(True) == [3]
    assert len(shards_of(False)) > 1  # the first commit does not wait for bodies not yet being decoded


@pytest.mark.parametrize("linger_queued", [False, True])
def test_a_lone_post_does_not_wait_and_a_failed_decode_releases_the_commit(tmp_path, linger_queued):
    async def scenario() -> tuple[float, float, list[int]]:
        committer, shards = await _committer(tmp_path, linger_s=5.0, linger_queued=linger_queued)
        started = time.perf_counter()
        with committer.arriving() as arrival:
            await committer.submit(_rows(2, 1), arrival)
        lone = time.perf_counter() - started

        async def failing() -> None:
            try:
                with committer.arriving() as arrival:
                    committer.announce(arrival)
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
                committer.announce(arrival)
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


def test_a_second_writer_commits_while_the_first_is_in_flight(tmp_path):
    """concurrency=2: a post that arrives while a shard is being written starts its own commit at once; every post
    is answered once its own shard is committed, and the log holds both records."""
    import threading

    store = ShardStore(tmp_path)
    started, release = threading.Event(), threading.Event()
    in_flight, most = [0], [0]
    lock = threading.Lock()
    commit = store.commit

    def slow_commit(*args, **kwargs):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        started.set()
        release.wait(5.0)
        try:
            return commit(*args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= 1

    store.commit = slow_commit

    async def scenario() -> list[int]:
        shards: list[int] = []
        committer = GroupCommitter(store, "api", "api", lambda record, rows: shards.append(rows.num_rows), concurrency=2)
        committer.start()
        first = asyncio.create_task(committer.submit(_rows(1, 1)))
        while not started.is_set():
            await asyncio.sleep(0.005)
        second = asyncio.create_task(committer.submit(_rows(2, 2)))
        for _ in range(1000):  # bounded: with one writer the second commit would never start here
            if most[0] >= 2:
                break
            await asyncio.sleep(0.005)
        release.set()
        await asyncio.gather(first, second)
        await committer.stop()
        return sorted(shards)

    assert asyncio.run(scenario()) == [1, 2]
    assert most[0] == 2
    assert sorted(record.rows for record in store.committed("api").values()) == [1, 2]


def test_the_committer_keeps_no_rows_once_their_commit_is_answered(tmp_path):
    """Its loop kept the last commit's requests (up to max_groups decoded groups) as locals while it waited for the
    next post: a server that went idle after a burst of 64-group posts held them (issue 29's RSS after a drain)."""
    import sys

    async def scenario() -> tuple[int, int]:
        committer, _ = await _committer(tmp_path, linger_s=0.0)
        rows = _rows(4, 1)
        before = sys.getrefcount(rows)
        await committer.submit(rows)
        for _ in range(5):  # the commit task's callbacks and the loop's next turn
            await asyncio.sleep(0)
        after = sys.getrefcount(rows)
        await committer.stop()
        return before, after

    before, after = asyncio.run(scenario())
    assert after == before


def test_a_pipelined_commit_starts_once_the_one_before_has_written_its_shard(tmp_path):
    """pipeline: the next commit waits while the one before is encoding its shard, starts once that shard's bytes
    are written (its fsyncs and record still to come), and its posts are answered only after the earlier ones,
    each once its own shard is committed."""
    import threading

    store = ShardStore(tmp_path)
    commit = store.commit
    entered: list[int] = []
    before_write, after_write = threading.Event(), threading.Event()

    def slow_commit(*args, **kwargs):
        entered.append(args[2])
        if len(entered) == 1:
            before_write.wait(5.0)  # still encoding
            on_written = kwargs.pop("on_written")

            def written() -> None:
                on_written()
                after_write.wait(5.0)  # written; its fsyncs take long

            return commit(*args, on_written=written, **kwargs)
        return commit(*args, **kwargs)

    store.commit = slow_commit

    async def scenario() -> list[str]:
        answered: list[str] = []
        committer = GroupCommitter(store, "api", "api", lambda record, rows: answered.append(f"served {record.chunk}"),
                                   pipeline=True)
        committer.start()

        async def post(name: str, rows) -> None:
            await committer.submit(rows)
            answered.append(name)

        first = asyncio.create_task(post("first", _rows(1, 1)))
        while not entered:
            await asyncio.sleep(0.005)
        second = asyncio.create_task(post("second", _rows(2, 2)))
        await asyncio.sleep(0.1)
        assert entered == [0]  # the first is still encoding: no second commit yet
        before_write.set()
        for _ in range(1000):
            if len(entered) == 2:
                break
            await asyncio.sleep(0.005)
        assert entered == [0, 1]  # started while the first waits for its fsyncs
        await asyncio.sleep(0.1)  # the second's shard is committed by now, the first's not
        assert answered == [] and store.record("api", shard_name("api", 1)) is not None
        after_write.set()
        await asyncio.gather(first, second)
        await committer.stop()
        return answered

    answered = asyncio.run(scenario())
    assert sorted(answered) == ["first", "second", "served 0", "served 1"]
    position = answered.index
    assert position("served 0") < position("first") < position("second") and position("served 0") < position("served 1") < position("second")
    assert sorted(record.rows for record in store.committed("api").values()) == [1, 2]
