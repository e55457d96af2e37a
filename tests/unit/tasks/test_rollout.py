"""A chunk's rollout task body (generate -> score -> group, plain functions) against a real HTTP server, and the
flow's shard commit with bounded, logged retries."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from bench.datagen import instant_server
from environments.base import EnvSpec
from factory.inference.client import InferenceConfig
from factory.store import ShardStore
from flows.datagen import ENVIRONMENTS
from tasks import shards
from tasks.rollout import rollout_chunk, rollout_task


@pytest.fixture(scope="module")
def chat_server():
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    async def serve() -> None:
        holder["server"] = await asyncio.start_server(instant_server.handle, "127.0.0.1", 0)
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(10)
    port = holder["server"].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(holder["server"].close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def arithmetic_spec(tokenizer: str, group_size: int = 4) -> EnvSpec:
    return EnvSpec(ENVIRONMENTS["intern_bootcamp"], {
        "task_name": "arithmetic", "difficulties": [1], "group_size": group_size, "total_items": 64,
        "max_tokens": 16, "tokenizer_name": tokenizer})


def test_one_rollout_call_generates_scores_and_groups_a_chunk(chat_server, tiny):
    spec = arithmetic_spec(str(tiny))
    config = InferenceConfig(base_url=chat_server, server_type="openai", model_name="m")
    grouped = rollout_chunk(spec, "intern_bootcamp", 3, range(24, 32), config,
                            generate=dict(tokenizer_name=str(tiny), api="chat"),
                            score=dict(mode="inline"),
                            group=dict(group_size=4, max_token_length=2048, run_id="r"))
    # every item either became a group of 4 scored sequences or was dropped with a counted reason
    assert len(grouped.groups) + sum(grouped.dropped.values()) == 8
    assert grouped.groups and all(len(g.scores) == 4 for g in grouped.groups)
    assert set(grouped.dropped) <= {"equal_scores"}
    assert all(len(set(g.scores)) > 1 for g in grouped.groups)  # scored: equal-score groups were dropped
    assert grouped.generate_s > 0 and grouped.rollouts == 32


def test_the_rollout_task_names_its_run_by_env_and_chunk_and_hashes_no_inputs():
    from prefect.cache_policies import NO_CACHE

    assert rollout_task.cache_policy is NO_CACHE
    assert rollout_task.task_run_name({"env": "gsm8k", "chunks": [(7, range(0, 2), None)]}) == "rollout-gsm8k-7-7"
    assert rollout_task.retries == 2


def test_a_failed_shard_commit_is_retried_with_a_warning_and_stored_once(tmp_path, monkeypatch, caplog):
    from factory.synthetic import synthetic_groups

    real, calls, slept = shards.write_shard, [], []

    def flaky(*args):
        calls.append(args[3])
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(shards, "write_shard", flaky)
    groups = list(synthetic_groups(3, seq_len=8))
    with caplog.at_level(logging.WARNING):
        record = shards.write_shard_retrying(str(tmp_path), "r", "w0", 5, groups, sleep=slept.append)
    assert calls == [5, 5] and slept == [1.0] and record.rows == 3
    assert "chunk 5: shard commit failed (OSError" in caplog.text and "retry 1 of 2" in caplog.text
    assert ShardStore(tmp_path).count("r") == 3


def test_shard_commit_retries_are_bounded(tmp_path, monkeypatch):
    attempts = []

    def broken(*args):
        attempts.append(1)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(shards, "write_shard", broken)
    with pytest.raises(OSError, match="Input/output"):
        shards.write_shard_retrying(str(tmp_path), "r", "w0", 0, [], delays_s=(0.5, 2.0), sleep=lambda s: None)
    assert len(attempts) == 3


def test_only_the_completed_record_of_a_rollout_task_run_is_dropped_from_the_run_log():
    from tasks.rollout import QuietCompletedRollouts, quiet_completed_rollouts

    def record(message, level=logging.INFO, task_name="rollout"):
        made = logging.LogRecord("prefect.task_runs", level, __file__, 1, message, None, None)
        made.task_name = task_name
        return made

    quiet = QuietCompletedRollouts()
    assert not quiet.filter(record("Finished in state Completed()"))
    assert quiet.filter(record("Finished in state Failed('Task run encountered an exception')", logging.ERROR))
    assert quiet.filter(record("Finished in state Completed()", task_name="write-shard"))  # other tasks: kept
    assert quiet.filter(record("Task run failed with exception: ... Retry 1/2 will start 5 second(s) from now",
                               logging.ERROR))
    quiet_completed_rollouts()
    quiet_completed_rollouts()  # once per process, however many chunks call it
    filters = logging.getLogger("prefect.task_runs").filters
    assert sum(isinstance(f, QuietCompletedRollouts) for f in filters) == 1


def test_write_shard_keeps_one_store_per_local_root_and_still_sees_commits_made_elsewhere(tmp_path):
    from factory.synthetic import synthetic_groups

    root = str(tmp_path / "store")
    groups = list(synthetic_groups(2, group_size=2))
    first = shards.write_shard(root, "r", "p", 0, groups)
    assert shards.store_at(root) is shards.store_at(root)  # its parsed commit log is kept between commits
    ShardStore(root).commit("r", "p", 1, groups)  # another writer (or process) commits chunk 1
    again = shards.write_shard(root, "r", "p", 1, groups)
    assert not first.skipped and again.skipped  # exactly once: the kept store read the other commit
    assert ShardStore(root).count("r") == 2 * len(groups)
    for i in range(shards._STORES_KEPT + 2):  # many roots: only the latest few are kept
        shards.store_at(str(tmp_path / f"other-{i}"))
    assert len(shards._stores) == shards._STORES_KEPT and root not in shards._stores
