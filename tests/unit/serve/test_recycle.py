"""Idle recycling's parts without a process exec: when it is due, what the old image hands over, and the dormant
start of the new one (tests/integration/test_serve_recycle.py runs the real exec)."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import orjson

from factory.serve import recycle
from factory.serve.config import ServeConfig
from factory.serve.recycle import RecyclePolicy
from factory.serve.service import BatchService
from factory.serve.state import BlockRows, ServedState
from factory.store import ShardStore
from factory.synthetic import synthetic_groups

REGISTRATION = dict(wandb_group="g", wandb_project="p", batch_size=8, max_token_len=64, checkpoint_dir="c",
                    save_checkpoint_interval=5, starting_step=0, num_steps=100)


def test_a_recycle_is_due_only_when_quiet_loaded_and_past_the_minimum_interval_or_work():
    policy = RecyclePolicy(idle_s=0.5, min_interval_s=60, last_recycle=(1000.0, 5.0), work_cpu_s=10)
    due = dict(quiet=lambda: True, requests_in_flight=0, heavy_loaded=True)
    assert policy.due(**due, now=1060.0, cpu_now=6.0)
    assert not policy.due(**due, now=1059.0, cpu_now=6.0)
    assert policy.due(**due, now=1001.0, cpu_now=15.0)  # 10 s of CPU worked since: a recycle is cheap beside it
    assert not policy.due(**{**due, "quiet": lambda: False}, now=2000.0, cpu_now=100.0)
    assert not policy.due(**{**due, "requests_in_flight": 1}, now=2000.0, cpu_now=100.0)
    assert not policy.due(**{**due, "heavy_loaded": False}, now=2000.0, cpu_now=100.0)
    assert RecyclePolicy(0.5, 60).due(**due)  # never recycled before
    assert not RecyclePolicy(0.0, 60).due(**due)  # recycle_idle_s 0: off


def test_the_last_recycle_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(recycle.RECYCLED_AT_ENV, raising=False)
    assert recycle.last_recycle_at() is None
    monkeypatch.setenv(recycle.RECYCLED_AT_ENV, "1000.5 3.25")
    assert recycle.last_recycle_at() == (1000.5, 3.25)
    monkeypatch.setenv(recycle.RECYCLED_AT_ENV, "garbage")
    assert recycle.last_recycle_at() is None


def test_heavy_modules_are_what_a_recycle_gives_back():
    assert recycle.heavy_modules_loaded({"pyarrow": object()})
    assert not recycle.heavy_modules_loaded({"orjson": object()})


def test_the_handover_is_read_once_from_the_environment(monkeypatch):
    monkeypatch.setenv(recycle.DORMANT_ENV, json.dumps({"queued_groups": 1}))
    assert recycle.take_handover() == {"queued_groups": 1}
    assert recycle.DORMANT_ENV not in os.environ and recycle.take_handover() is None
    monkeypatch.setenv(recycle.DORMANT_ENV, "{not json")
    assert recycle.take_handover() is None


def test_the_listening_socket_is_inherited_by_its_descriptor(monkeypatch):
    first = recycle.listening_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    monkeypatch.setenv(recycle.LISTEN_FD_ENV, str(first.detach()))
    assert recycle.was_recycled()
    again = recycle.listening_socket("127.0.0.1", 0)
    try:
        assert again.getsockname()[1] == port and not again.get_inheritable()
        assert recycle.LISTEN_FD_ENV not in os.environ
    finally:
        again.close()


def test_untaken_rows_counts_shards_and_blocks_less_what_was_taken(tmp_path):
    state = ServedState(tmp_path / "state.sqlite")
    state.add_sources([("r", "a", 3, ()), ("r", "merged", BlockRows(0, np.array([2, 5])), ()), ("r", "b", 4, ())])
    assert state.untaken_rows() == 3 + 7 + 4
    state.record_taken([(1, 0), (1, 2), (3, 1)], 0)
    assert state.untaken_rows() == 14 - 3
    state.close()


def config(root, **serve) -> ServeConfig:
    return ServeConfig(store_root=str(root), follow_interval_s=0.05, prefetch=False, **serve)


async def drain(service: BatchService) -> list[str]:
    served = []
    while (batch := orjson.loads((await service.next_batch(False)).raw)["batch"]) is not None:
        served += [group["tokens"][0][0] for group in batch]
    return served


def groups(start: int, count: int):
    made = list(synthetic_groups(count, group_size=4, seq_len=8))
    for i, group in enumerate(made):
        group.tokens[0][0] = start + i
        group.group_id = f"group-{start + i}"
    return made


async def stopped_for_recycle(service: BatchService) -> dict:
    service.recycling = True
    await service.stop()
    assert service.handover is not None
    return service.handover


async def drained_and_recycled(root, count: int, **serve) -> tuple[list[int], dict]:
    """A service that got `count` groups of 4 (batches of 8 sequences), served every batch it could, and stopped to
    recycle: what it served and what it handed over."""
    service = BatchService(config(root, **serve))
    await service.start()
    await service.register(REGISTRATION)
    await service.ingest(groups(0, count))
    served = await drain(service)
    return served, await stopped_for_recycle(service)


def test_a_new_image_starts_dormant_on_what_the_old_one_handed_over_and_serves_each_group_once(tmp_path):
    async def scenario():
        service = BatchService(config(tmp_path))
        await service.start()
        await service.register(REGISTRATION)
        await service.ingest(groups(0, 5))  # two batches of two groups of 4, one group left
        first = await drain(service)
        assert service.quiet(0.0, 0.0)
        handover = await stopped_for_recycle(service)
        assert handover["queued_groups"] == 1 and handover["queued_sequences"] == 4

        service = BatchService(config(tmp_path), handover)
        await service.start()
        assert service.dormant and not service.quiet(0.0, 0.0)
        status = service.status()
        assert (status["queue_size"], status["queued_sequences"], status["current_step"]) == (1, 4, 2)
        assert orjson.loads((await service.next_batch(False)).raw)["batch"] is None
        latest = orjson.loads(await service.latest_example())  # the group posted last, as before the recycle
        assert latest["tokens"][0][0] == 4 and not service.dormant
        await service.ingest(groups(100, 1))
        assert orjson.loads(await service.latest_example())["tokens"][0][0] == 100
        second = await drain(service)
        await service.stop()
        return first, second

    first, second = asyncio.run(scenario())
    assert sorted(first) == [0, 1, 2, 3] and sorted(second) == [4, 100]


def test_a_commit_after_the_handover_makes_the_new_image_index_at_start(tmp_path):
    async def scenario():
        _, handover = await drained_and_recycled(tmp_path, 3)
        ShardStore(tmp_path).commit("api", "another-producer", 0, groups(50, 1))  # the ingest run's log moves

        service = BatchService(config(tmp_path), handover)
        await service.start()
        dormant = service.dormant
        served = await drain(service)
        await service.stop()
        return dormant, served

    dormant, served = asyncio.run(scenario())
    assert not dormant and sorted(served) == [2, 50]


def test_a_dormant_image_wakes_when_a_followed_log_moves(tmp_path):
    async def scenario():
        _, handover = await drained_and_recycled(tmp_path, 3)
        service = BatchService(config(tmp_path), handover)
        await service.start()
        assert service.dormant
        ShardStore(tmp_path).commit("api", "another-producer", 0, groups(50, 1))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not service.dormant and service.queue.groups == 2:
                break
        served = await drain(service)
        await service.stop()
        return served

    assert sorted(asyncio.run(scenario())) == [2, 50]


def test_a_dormant_image_with_nothing_queued_takes_a_trainer_and_polls_without_waking(tmp_path):
    async def scenario():
        _, handover = await drained_and_recycled(tmp_path, 4)
        assert handover["queued_groups"] == 0

        service = BatchService(config(tmp_path), handover)
        await service.start()
        await service.register({**REGISTRATION, "batch_size": 4, "starting_step": 2})  # where it left off: no replay
        service.register_env(dict(max_token_length=64, desired_name="e", weight=1.0, group_size=4))
        polled = orjson.loads((await service.next_batch(False)).raw)["batch"]
        dormant, status = service.dormant, service.status()
        latest = orjson.loads(await service.latest_example())  # all served: still the group posted last
        await service.stop()
        return dormant, polled, status, latest

    dormant, polled, status, latest = asyncio.run(scenario())
    assert dormant and polled is None and (status["queue_size"], status["served_groups"]) == (0, 4)
    assert latest["tokens"][0][0] == 3


def test_a_service_whose_logs_cannot_be_named_never_looks_quiet(tmp_path):
    async def scenario():
        service = BatchService(config(tmp_path, follow_runs=["*"]))
        await service.start()
        await service.register(REGISTRATION)
        await service.ingest(groups(0, 2))
        await drain(service)
        quiet = service.quiet(0.0, 0.0)
        await service.stop()
        return quiet

    assert asyncio.run(scenario()) is False  # a new image would index at its start: nothing given back
