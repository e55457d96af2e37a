"""Rollout task runs covering several chunks (datagen.min_task_s): how many chunks a task run covers, the per-chunk
view of its future, the window counting task runs, and commits staying per chunk and in order."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from factory.datagen.run import ChunkOfTask, ChunksInFlight, DatagenRun, PlannedChunk, chunks_per_task
from factory.sampling import DynamicSampling
from factory.store import ShardStore

RUN, PRODUCER = "bundles", "p"


class FakeFuture:
    """A task run's future: a list of values once finished."""

    def __init__(self, values=None):
        self.values, self.waited = values, []
        self.state = SimpleNamespace(is_final=lambda: self.values is not None)

    def result(self, timeout=None):
        if self.values is None:
            raise TimeoutError
        return self.values

    def wait(self, timeout=None):
        self.waited.append(timeout)


def test_a_task_run_covers_chunks_until_their_expected_time_reaches_min_task_s():
    assert chunks_per_task(1.0, None, 32) == 1  # nothing measured yet: one chunk
    assert chunks_per_task(0.0, 0.03, 32) == 1  # 0: one chunk per task run
    assert chunks_per_task(1.0, 0.25, 32) == 4
    assert chunks_per_task(1.0, 0.3, 32) == 4  # the chunk that reaches the target is included
    assert chunks_per_task(1.0, 0.03, 32) == 32  # capped
    assert chunks_per_task(1.0, 0.0, 5) == 5
    assert chunks_per_task(1.0, 3.0, 32) == 1  # a slow chunk is a task run of its own


def test_a_chunk_of_a_task_run_is_its_item_of_the_task_runs_future():
    future = FakeFuture()
    second = ChunkOfTask(future, 1)
    assert not second.state.is_final()
    with pytest.raises(TimeoutError):
        second.result(timeout=1.0)
    second.wait(timeout=2.5)
    assert future.waited == [2.5]
    future.values = ["groups-0", "groups-1", "groups-2"]
    assert second.state.is_final() and second.result() == "groups-1" and ChunkOfTask(future, 2).result() == "groups-2"


def test_the_window_counts_task_runs_and_commits_chunks_in_order(tmp_path):
    sampler = DynamicSampling(ShardStore(tmp_path), run_id=RUN, producer=PRODUCER, chunk_items=4, total_items=80)
    window = ChunksInFlight(2, sampler)
    first = FakeFuture(["g0", "g1", "g2"])
    window.add_task([PlannedChunk(k, range(4 * k, 4 * k + 4)) for k in range(3)], first)
    assert not window.full() and len(window) == 3 and window.tasks() == 1 and window.items() == 12
    window.add(PlannedChunk(3, range(12, 16)), "g3")  # a one-chunk task run whose future is the chunk's groups
    assert window.full() and window.chunks() == [0, 1, 2, 3]
    popped = [window.pop() for _ in range(2)]
    assert [planned.chunk for planned, _ in popped] == [0, 1] and [h.result() for _, h in popped] == ["g0", "g1"]
    assert window.full()  # chunk 2 of the first task run is still in the window
    planned, handle = window.pop()
    assert planned.chunk == 2 and handle.result() == "g2" and not window.full() and window.tasks() == 1
    assert window.pop() == (PlannedChunk(3, range(12, 16)), "g3") and not window


class Planning(DatagenRun):
    """`stopping` turns true after `stopping_after` polls (None: never)."""

    @property
    def stopping(self) -> bool:
        self.polls += 1
        return self.stopping_after is not None and self.polls > self.stopping_after


def _planning_run(tmp_path, *, total_items=400, chunk_items=4, target_groups=None, min_task_s=1.0, most=32,
                  in_flight=2, generate_ms=0, chunks=0, stopping_after=None):
    """A DatagenRun with only what `plan_next` touches; commits are recorded, not written."""
    sampler = DynamicSampling(ShardStore(tmp_path), run_id=RUN, producer=PRODUCER, chunk_items=chunk_items,
                              total_items=total_items, target_groups=target_groups, chunks_in_flight=in_flight)
    run = Planning.__new__(Planning)
    run.cfg = SimpleNamespace(datagen=SimpleNamespace(min_task_s=min_task_s, max_task_chunks=most))
    run.sampler, run.backpressure = sampler, None
    run.window = ChunksInFlight(in_flight, sampler)
    run.committer = SimpleNamespace(session=Counter(generate_ms=generate_ms, chunks=chunks))
    run.committed = []
    run.polls, run.stopping_after = 0, stopping_after
    run._commit = lambda chunk, grouped: (run.committed.append((chunk, grouped)), sampler.committed_chunks.add(chunk))
    run.ops = SimpleNamespace(check_prefect_api=lambda: None, result=lambda future: future.result())
    return run


def test_the_first_task_runs_are_one_chunk_then_bundles_are_sized_from_the_measured_seconds(tmp_path):
    run = _planning_run(tmp_path)
    assert [p.chunk for p in run.plan_next()] == [0]  # no measurement: one chunk
    run.committer.session.update(generate_ms=250, chunks=1)  # 0.25 s per chunk -> 4 chunks make 1 s
    chunks = run.plan_next()
    assert [p.chunk for p in chunks] == [1, 2, 3, 4] and chunks[1].indices == range(8, 12)
    run.committer.session.update(generate_ms=2000, chunks=100)  # 0.02 s per chunk: capped at 32
    run.cfg.datagen.max_task_chunks = 3
    assert [p.chunk for p in run.plan_next()] == [5, 6, 7]


def test_min_task_s_0_plans_one_chunk_per_task_run(tmp_path):
    run = _planning_run(tmp_path, min_task_s=0.0, generate_ms=10, chunks=10)
    assert [len(run.plan_next()) for _ in range(3)] == [1, 1, 1]


def test_a_bundle_stops_where_the_chunks_run_out(tmp_path):
    run = _planning_run(tmp_path, total_items=10, generate_ms=10, chunks=10)  # chunks 0, 1 and the 2-item chunk 2
    chunks = run.plan_next()
    assert [p.chunk for p in chunks] == [0, 1, 2] and chunks[-1].indices == range(8, 10)
    run.in_flight(chunks, FakeFuture(["g0", "g1", "g2"]))
    assert run.plan_next() is None


def test_a_bundle_stops_once_what_is_in_flight_may_reach_the_target(tmp_path):
    from tests.unit.datagen.test_run_parts import committer_for, grouped_chunk

    run = _planning_run(tmp_path, total_items=1, target_groups=10, generate_ms=10, chunks=10)
    committer_for(run.sampler.store, run.sampler).commit(0, grouped_chunk(0, 4))  # 4 of 4 items kept
    assert run.sampler.next_chunk() == 1 and run.sampler.peek_chunk() == 2  # chunk 0 committed, skipped
    run.sampler._next = 1
    # 6 groups left at 1 per item: chunks 1 and 2 (8 items) may reach it, so no third chunk joins the task run
    assert [p.chunk for p in run.plan_next()] == [1, 2]


def test_a_stop_signal_ends_the_bundle_and_the_next_plan(tmp_path):
    run = _planning_run(tmp_path, generate_ms=10, chunks=10, stopping_after=2)
    assert [p.chunk for p in run.plan_next()] == [0, 1]  # polls: before drawing, adding chunk 1, then the signal
    assert run.plan_next() is None


def test_a_full_window_commits_every_chunk_of_the_oldest_task_run_in_order_before_planning(tmp_path):
    run = _planning_run(tmp_path)
    zero = run.plan_next()
    run.in_flight(zero, FakeFuture(["g0"]))  # one chunk: still a list of one, as rollout_chunks returns
    run.committer.session.update(generate_ms=1000, chunks=4)  # 0.25 s per chunk: 4 chunks per task run
    first = run.plan_next()
    assert [p.chunk for p in first] == [1, 2, 3, 4]
    run.in_flight(first, FakeFuture([f"g{p.chunk}" for p in first]))
    second = run.plan_next()  # window full (2 task runs): commits the whole oldest one (chunk 0) first
    assert run.committed == [(0, "g0")] and [p.chunk for p in second] == [5, 6, 7, 8]
    run.in_flight(second, FakeFuture())  # still generating
    run.plan_next()  # commits chunks 1-4 one by one, in order, and not one of the running task run
    assert run.committed[1:] == [(1, "g1"), (2, "g2"), (3, "g3"), (4, "g4")] and run.window.chunks() == [5, 6, 7, 8]


def test_after_a_stop_every_chunk_of_an_unfinished_task_run_is_abandoned(tmp_path):
    sampler = DynamicSampling(ShardStore(tmp_path), run_id=RUN, producer=PRODUCER, chunk_items=4, total_items=80)
    run = Planning.__new__(Planning)
    run.polls, run.stopping_after = 0, 0
    run.window = ChunksInFlight(2, sampler)
    run.window.add_task([PlannedChunk(k, range(4 * k, 4 * k + 4)) for k in range(2)], FakeFuture(["g0", "g1"]))
    run.window.add_task([PlannedChunk(k, range(4 * k, 4 * k + 4)) for k in range(2, 5)], FakeFuture())
    run.committed = []
    run._commit = lambda chunk, grouped: run.committed.append((chunk, grouped))
    run.ops = SimpleNamespace(result=lambda future: future.result(),
                              finishes_in_grace=lambda future: (future.wait(0.0), future.state.is_final())[1])
    run.commit_remaining()
    assert run.committed == [(0, "g0"), (1, "g1")] and run.window.chunks() == [2, 3, 4]


def test_the_rollout_task_runs_each_chunk_in_order_with_its_own_plan(monkeypatch):
    import tasks.rollout as rollout

    calls = []
    monkeypatch.setattr(rollout, "rollout_chunk", lambda spec, env, chunk, indices, openai, *, generate, score, group:
                        calls.append((chunk, list(indices), generate["plan"], generate["api"])) or f"g{chunk}")
    grouped = rollout.rollout_chunks("spec", "toy", [(3, range(6, 8), None), (4, range(8, 10), {"f": 2})], "openai",
                                     generate={"api": "chat"}, score={}, group={})
    assert grouped == ["g3", "g4"]
    assert calls == [(3, [6, 7], None, "chat"), (4, [8, 9], {"f": 2}, "chat")]
    assert rollout.rollout_run_name({"env": "toy", "chunks": [(3, range(6, 8), None), (4, range(8, 10), None)]}) \
        == "rollout-toy-3-4"


def test_with_a_curriculum_a_chunk_joins_a_task_run_only_once_its_plan_is_final(tmp_path):
    """Chunk k is drawn with the state after chunk k - lag: a task run never covers a chunk whose plan could still
    change, so a rerun draws the same items as an uninterrupted run."""
    run = _planning_run(tmp_path, generate_ms=10, chunks=10, in_flight=2)
    run.sampler.curriculum = SimpleNamespace(plan=lambda: {"f": 1})  # plan_for: the initial plan before any commit
    assert [run.sampler.plan_final(k) for k in range(4)] == [True, True, False, False]
    assert [p.chunk for p in run.plan_next()] == [0, 1]  # chunk 2 needs chunk 0 committed
    run.in_flight([PlannedChunk(0, range(0, 4)), PlannedChunk(1, range(4, 8))], FakeFuture(["g0", "g1"]))
    assert [p.chunk for p in run.plan_next()] == [2]  # chunk 0 committed first (chunk 2's plan), chunk 1 not yet
    assert run.committed == [(0, "g0")] and run.window.chunks() == [1]
    run.in_flight([PlannedChunk(2, range(8, 12))], FakeFuture(["g2"]))
    assert [p.chunk for p in run.plan_next()] == [3]  # after committing chunk 1; chunk 4 would need chunk 2
    assert run.committed == [(0, "g0"), (1, "g1")]
