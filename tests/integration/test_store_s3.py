"""run-api, export and the viewer over a store on an S3-compatible object store (a local moto server started and
stopped by the test): what users rely on is the same as on a local store."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import orjson
import pytest

from factory.serve.config import ServeConfig
from factory.serve.service import BatchService
from factory.store import ShardStore
from factory.store_object import open_store
from factory.synthetic import synthetic_groups
from tests.moto_s3 import bucket, no_credentials, s3_endpoint  # noqa: F401 - fixtures

REGISTRATION = dict(
    wandb_group="g", wandb_project="p", batch_size=8, max_token_len=64,
    checkpoint_dir="ckpt", save_checkpoint_interval=5, starting_step=0, num_steps=1000,
)


def _ids(body: bytes) -> list[str]:
    data = orjson.loads(body)
    return [item["group_id"] for item in data["batch"]] if data.get("batch") else []


async def _drain(service: BatchService, expected: int, timeout_s: float = 20.0) -> list[str]:
    """Batches until `expected` groups were served (or the time is up); the served ids in order."""
    served: list[str] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(served) < expected and loop.time() < deadline:
        ids = _ids((await service.next_batch(False)).raw)
        if not ids:
            await asyncio.sleep(0.05)
        served += ids
    return served


def test_run_api_follows_an_object_store_and_serves_each_group_once(bucket, tmp_path):
    _, name = bucket
    url = f"s3://{name}/store"
    writer = open_store(url)
    groups = list(synthetic_groups(64, group_size=2, seq_len=8, env="e"))
    writer.commit("gen", "w0", 0, groups[:16])
    config = ServeConfig(store_root=url, state_path=str(tmp_path / "state.sqlite"), follow_runs=["gen"],
                         follow_interval_s=0.05, batch_metadata=True)

    async def first_life() -> list[str]:
        service = BatchService(config)
        await service.start()
        await service.register(REGISTRATION)
        served = await _drain(service, 16)
        # Commits while the service runs, from two producers (two datagen workers): the follower picks them up.
        await asyncio.to_thread(writer.commit, "gen", "w0", 1, groups[16:24])
        await asyncio.to_thread(open_store(url).commit, "gen", "w1", 0, groups[24:32])
        served += await _drain(service, 16)
        # Groups posted to the API are committed to the object store too, and served once.
        await service.ingest(groups[32:40])
        served += await _drain(service, 8)
        await service.stop()
        return served

    async def second_life() -> list[str]:  # a restart with the same served state, then more commits
        service = BatchService(config)
        await service.start()
        served = await _drain(service, 0)
        assert service.queue.groups == 0
        await asyncio.to_thread(writer.commit, "gen", "w0", 2, groups[40:64])
        served += await _drain(service, 24)
        await asyncio.sleep(0.3)  # several more follower polls: nothing comes back
        served += _ids((await service.next_batch(False)).raw)
        await service.stop()
        return served

    first = asyncio.run(first_life())
    second = asyncio.run(second_life())
    served = first + second
    assert len(served) == len(set(served)) == 64
    assert set(served) == {g.group_id for g in groups}
    assert "api" in open_store(url).runs()  # the ingest run lives in the bucket; the served state stays local
    assert not Path(tmp_path / "s3:").exists()
