"""End to end: an Atropos-protocol env posts groups, datagen commits shards, a trainer pulls every group exactly once,
also across `kill -9` restarts of the service."""

from __future__ import annotations

import random
import sys
import threading
import time
import uuid
from collections import Counter

import httpx
import orjson
import pytest

from factory.serve.client import ApiProcess, EnvClient, TrainerClient
from factory.store import ShardStore
from factory.synthetic import synthetic_groups
from tests.conftest import free_port

pytestmark = pytest.mark.integration

BATCH = 32


def wire(group) -> dict:
    return orjson.loads(orjson.dumps(group.wire_dict()))


def content(group: dict) -> bytes:
    """Groups are told apart by content here (every test group is distinct); the service never dedups by it."""
    return orjson.dumps([group["tokens"], group["scores"]])


def post_all(env: EnvClient, groups: list[dict], stop: threading.Event, errors: list[str]) -> None:
    """Post in random chunks; like Atropos's env, retry transport errors and 5xx, never 4xx."""
    rng = random.Random(1)
    index, key = 0, None
    while index < len(groups) and not stop.is_set():
        if key is None:  # a new chunk; a retried chunk keeps its size and its Idempotency-Key
            chunk, key = groups[index : index + rng.randint(1, 6)], uuid.uuid4().hex
        try:
            reply = env.post(chunk, idempotency_key=key)
        except httpx.TransportError:
            time.sleep(0.2)
            continue
        if reply.status_code >= 500:
            time.sleep(0.2)
            continue
        if reply.status_code != 200:
            errors.append(reply.text)
            return
        index, key = index + len(chunk), None
        time.sleep(0.005)


def run_training(tmp_path, kills: int) -> tuple[Counter, set[str]]:
    root = tmp_path / "store"
    store = ShardStore(root)
    generated = list(synthetic_groups(20, group_size=8, seq_len=32, run_id="gen", env="datagen"))
    store.commit("gen", "worker0", 0, generated[:10])

    port = free_port()
    command = [sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1",
               "--store_root", str(root), "--follow_runs", "[gen]", "--follow_interval_s", "0.1",
               "--batch_metadata", "true", "--log_level", "warning"]
    api = ApiProcess(command, port, log_path=str(tmp_path / "api.log")).start()
    trainer, env = TrainerClient(api.url, timeout=10), EnvClient(api.url, timeout=10)
    try:
        trainer.register(BATCH)
        first = trainer.batch()  # starts training (Atropos envs may register only after this)
        assert first is not None and sum(len(g["tokens"]) for g in first) == BATCH
        env.register("math", group_size=4)
        posted = [wire(g) for g in synthetic_groups(100, group_size=4, seq_len=48, seed=3)]
        posted += [wire(g) for g in synthetic_groups(50, group_size=8, seq_len=24, seed=4)]
        random.Random(0).shuffle(posted)
        expected = {content(g) for g in posted} | {content(wire(g)) for g in generated}
        assert len(expected) == len(posted) + len(generated)
        total_sequences = sum(len(g["tokens"]) for g in posted) + 20 * 8
        assert total_sequences % BATCH == 0

        stop, errors = threading.Event(), []
        poster = threading.Thread(target=post_all, args=(env, posted, stop, errors), daemon=True)
        poster.start()
        served: Counter = Counter(content(g) for g in first)
        batches = 1
        kill_at = {6 * (k + 1) for k in range(kills)}
        deadline = time.monotonic() + 120
        while batches < total_sequences // BATCH and time.monotonic() < deadline:
            if batches == 8:
                store.commit("gen", "worker0", 1, generated[10:])  # datagen keeps committing while serving
            if batches in kill_at:
                kill_at.discard(batches)
                api.kill9()
                api.start()
            try:
                batch = trainer.batch()
            except (httpx.TransportError, ValueError):
                # The service went away mid-request: resume where this trainer's checkpoint is.
                while True:
                    try:
                        trainer.register(BATCH, starting_step=batches)
                        break
                    except httpx.TransportError:
                        time.sleep(0.2)
                continue
            if batch is None:
                time.sleep(0.05)
                continue
            assert sum(len(g["tokens"]) for g in batch) == BATCH
            served.update(content(g) for g in batch)
            batches += 1
        stop.set()
        poster.join(timeout=10)
        assert not errors, errors
        return served, expected
    finally:
        api.stop()


def test_every_group_is_served_exactly_once(tmp_path):
    served, expected = run_training(tmp_path, kills=0)
    assert set(served) == expected
    assert max(served.values()) == 1


def test_kill_9_mid_training_loses_nothing_and_serves_nothing_twice(tmp_path):
    served, expected = run_training(tmp_path, kills=2)
    assert set(served) == expected, f"missing {len(expected - set(served))}, unexpected {len(set(served) - expected)}"
    assert [gid for gid, n in served.items() if n > 1] == []
