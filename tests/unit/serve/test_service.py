"""BatchService without HTTP: durable served state, restarts, resume, staleness, following the store."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import orjson
import pytest

from factory.serve.config import ServeConfig
from factory.serve.payload import PayloadReader, batch_json, encode_groups
from factory.serve.service import BatchService
from factory.store import ShardStore
from factory.synthetic import synthetic_groups

REGISTRATION = dict(
    wandb_group="g", wandb_project="p", batch_size=8, max_token_len=64,
    checkpoint_dir="ckpt", save_checkpoint_interval=5, starting_step=0, num_steps=100,
)


def run(coro):
    return asyncio.run(coro)


def config(root: Path, **kwargs) -> ServeConfig:
    return ServeConfig(store_root=str(root), follow_interval_s=0.05, **kwargs)


async def started(cfg: ServeConfig) -> BatchService:
    service = BatchService(cfg)
    await service.start()
    return service


def batch_ids(body: bytes) -> list[str]:
    data = orjson.loads(body)
    return [item["group_id"] for item in data["batch"]] if data.get("batch") else []


def test_payload_encoding_matches_the_wire_dict(tmp_path):
    store = ShardStore(tmp_path)
    groups = list(synthetic_groups(20, group_size=3, seq_len=12))
    groups[4].advantages = [[0.5] * 12 for _ in range(3)]
    groups[5].distill_token_ids = [[[1, 2]] * 12 for _ in range(3)]
    groups[5].distill_logprobs = [[[-0.1, -2.0]] * 12 for _ in range(3)]
    store.commit("r", "p", 0, groups, row_group_groups=4)
    path = store.shard_paths("r")[0]
    rows = [7, 4, 5, 19, 0]
    decoded = orjson.loads(batch_json(encode_groups(PayloadReader(1 << 20).read([(path, r) for r in rows]))))
    expected = [json.loads(json.dumps(groups[r].wire_dict())) for r in rows]
    assert decoded["batch"] == expected


def test_posted_groups_are_served_once_across_restarts(tmp_path):
    async def scenario():
        cfg = config(tmp_path, batch_metadata=True)
        service = await started(cfg)
        await service.register(REGISTRATION)
        posted = list(synthetic_groups(10, group_size=4, seq_len=8))
        await service.ingest(posted[:6])
        first = batch_ids((await service.next_batch(False)).raw)
        await service.stop()  # the prefetched batch is not served: its groups must come back

        service = await started(cfg)
        assert service.step == 1 and service.registration["batch_size"] == 8
        await service.ingest(posted[6:])
        served = first
        while ids := batch_ids((await service.next_batch(False)).raw):
            served += ids
        await service.stop()
        return posted, served

    posted, served = run(scenario())
    assert sorted(served) == sorted(g.group_id for g in posted)


def test_reregistering_with_starting_step_replays_from_there(tmp_path):
    async def scenario():
        cfg = config(tmp_path, batch_metadata=True)
        service = await started(cfg)
        await service.register(REGISTRATION)
        await service.ingest(list(synthetic_groups(8, group_size=4, seq_len=8)))
        batches = [batch_ids((await service.next_batch(False)).raw) for _ in range(4)]
        assert service.step == 4
        await service.register({**REGISTRATION, "starting_step": 2})
        assert service.step == 2
        replayed = [batch_ids((await service.next_batch(False)).raw) for _ in range(2)]
        await service.stop()
        return batches, replayed, service.step

    batches, replayed, step = run(scenario())
    assert replayed == batches[2:] and step == 4


def test_groups_too_many_versions_behind_are_skipped_and_counted(tmp_path):
    store = ShardStore(tmp_path)
    store.commit("gen", "w", 0, list(synthetic_groups(4, group_size=4, policy_version=0)))
    store.commit("gen", "w", 1, list(synthetic_groups(4, start=4, group_size=4, policy_version=5)))

    async def scenario():
        service = await started(config(tmp_path, follow_runs=["gen"], max_policy_lag=2, batch_metadata=True))
        await service.register({**REGISTRATION, "starting_step": 6})
        body = orjson.loads((await service.next_batch(False)).raw)
        status = service.status()
        await service.stop()
        return body, status

    body, status = run(scenario())
    assert {item["policy_version"] for item in body["batch"]} == {5}
    assert status["skipped_stale"] == 4


def test_follows_runs_as_they_grow(tmp_path):
    store = ShardStore(tmp_path)

    async def scenario():
        service = await started(config(tmp_path, follow_runs=["*"]))
        await service.register(REGISTRATION)
        assert orjson.loads((await service.next_batch(False)).raw) == {"batch": None}
        await asyncio.to_thread(store.commit, "gen-1", "w", 0, list(synthetic_groups(2, group_size=4)))
        for _ in range(100):
            if service.queue.groups:
                break
            await asyncio.sleep(0.02)
        body = orjson.loads((await service.next_batch(False)).raw)
        await service.stop()
        return body

    body = run(scenario())
    assert [len(item["tokens"]) for item in body["batch"]] == [4, 4]


def test_reset_discards_the_queue_and_registration(tmp_path):
    async def scenario():
        cfg = config(tmp_path)
        service = await started(cfg)
        await service.register(REGISTRATION)
        await service.ingest(list(synthetic_groups(3, group_size=4)))
        await service.reset()
        assert service.registration is None and service.queue.groups == 0
        await service.stop()
        service = await started(cfg)
        queued = service.queue.groups
        await service.stop()
        return queued

    assert run(scenario()) == 0


@pytest.mark.parametrize("bad", [{"env_id": 99}, {"env_id": -1}])
def test_status_env_of_unknown_env_is_none(tmp_path, bad):
    async def scenario():
        service = await started(config(tmp_path))
        result = service.status_env(bad["env_id"])
        await service.stop()
        return result

    assert run(scenario()) is None


def test_batch_order_newest_first_serves_the_latest_groups_first(tmp_path):
    async def scenario(order):
        service = await started(config(tmp_path / order, batch_metadata=True, batch_order=order, prefetch=False))
        await service.register(REGISTRATION)
        posted = list(synthetic_groups(6, group_size=4, seq_len=8))
        await service.ingest(posted)
        first = batch_ids((await service.next_batch(False)).raw)
        await service.stop()
        return [g.group_id for g in posted], first

    posted, oldest = run(scenario("oldest_first"))
    assert oldest == posted[:2]
    posted, newest = run(scenario("newest_first"))
    assert newest == [posted[5], posted[4]]


def test_a_drained_queue_drops_the_payload_cache(tmp_path):
    async def scenario():
        service = await started(config(tmp_path, prefetch=False, batch_metadata=True))
        await service.register(REGISTRATION)
        await service.ingest(list(synthetic_groups(4, group_size=4, seq_len=8)))
        while batch_ids((await service.next_batch(False)).raw):
            assert service.reader._cache  # row groups read for the batch stay cached while groups are queued
        held = dict(service.reader._cache)
        await service.stop()
        return held

    assert run(scenario()) == {}


def test_less_than_a_batch_left_drops_the_payload_cache(tmp_path):
    async def scenario():
        service = await started(config(tmp_path, batch_metadata=True))
        await service.register(REGISTRATION)
        await service.ingest(list(synthetic_groups(5, group_size=4, seq_len=8)))  # two batches of 8, 4 sequences left
        while batch_ids((await service.next_batch(False)).raw):
            pass
        held, queued = dict(service.reader._cache), service.queue.groups
        await service.stop()
        return held, queued

    held, queued = run(scenario())
    assert queued == 1 and held == {}  # no batch can be formed until more arrive: nothing is kept for it


def test_a_gzip_client_gets_only_the_gzip_and_the_next_client_without_gzip_gets_json(tmp_path):
    async def scenario():
        service = await started(config(tmp_path, batch_metadata=True, gzip_min_bytes=0))
        await service.register(REGISTRATION)
        posted = list(synthetic_groups(6, group_size=4, seq_len=8))
        await service.ingest(posted)
        first = await service.next_batch(True)
        await service._prefetch_task  # the next one, made for a gzip client too
        prefetched = service._prefetched[1]
        assert prefetched.raw is None and prefetched.gz is not None
        second = await service.next_batch(False)  # a client without gzip: JSON made again from the rows' keys
        third = await service.next_batch(True)
        await service.stop()
        return posted, [first, second, third]

    posted, bodies = run(scenario())
    assert bodies[0].raw is None and bodies[0].gz is not None  # the JSON is not kept beside its gzip
    assert bodies[1].raw is not None
    served = [i for body in bodies for i in batch_ids(body.raw if body.raw is not None else gzip.decompress(body.gz))]
    assert served == [g.group_id for g in posted]
