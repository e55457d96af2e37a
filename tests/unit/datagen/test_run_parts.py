"""The datagen run's plain parts (factory/datagen/): the in-flight window, the chunk committer, the summary and the
import layering (flows import factory.datagen, never the reverse, and the flow's CLI does not import the flow)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from environments.base import Item, Rollout
from factory.datagen.run import ChunkCommitter, ChunksInFlight, PlannedChunk
from factory.datagen.summary import covered
from factory.sampling import DynamicSampling, chunk_stats_name
from factory.store import ShardStore
from tasks.group import group_chunk

REPO = Path(__file__).resolve().parents[3]
RUN, PRODUCER = "parts", "p"


def grouped_chunk(first: int, n_items: int, *, started_at: float = 10.0, generate_s: float = 2.0):
    items = [Item(key=f"k{i}", messages=[{"role": "user", "content": "q"}]) for i in range(first, first + n_items)]
    rollouts = [[Rollout(item.key, "t", [1, 2], [3, 4], [-0.1, -0.1], "stop", 0, score=float(j)) for j in range(2)]
                for item in items]
    grouped = group_chunk("toy", items, rollouts, group_size=2, max_token_length=100, run_id=RUN)
    grouped.generate_started_at, grouped.generate_s = started_at, generate_s
    return grouped


def committer_for(store: ShardStore, sampler: DynamicSampling, **kwargs) -> ChunkCommitter:
    return ChunkCommitter(store, root="unused", run_id=RUN, producer=PRODUCER, sampler=sampler,
                          write_shard=lambda _root, run, producer, chunk, groups: store.commit(run, producer, chunk,
                                                                                              groups), **kwargs)


def test_the_window_holds_back_the_oldest_chunk_once_it_is_full(tmp_path):
    sampler = DynamicSampling(ShardStore(tmp_path), run_id=RUN, producer=PRODUCER, chunk_items=4, total_items=40)
    window = ChunksInFlight(2, sampler)
    assert not window.full() and len(window) == 0
    window.add(PlannedChunk(0, range(0, 4)), "future-0")
    assert not window.full() and window.items() == 4
    window.add(PlannedChunk(1, range(4, 8)), "future-1")
    assert window.full() and window.oldest() == "future-0" and window.chunks() == [0, 1]
    assert window.pop() == (PlannedChunk(0, range(0, 4)), "future-0") and not window.full()


def test_a_target_run_commits_before_the_items_in_flight_could_overshoot(tmp_path):
    store = ShardStore(tmp_path)
    sampler = DynamicSampling(store, run_id=RUN, producer=PRODUCER, chunk_items=3, total_items=1, target_groups=5)
    committer_for(store, sampler).commit(0, grouped_chunk(0, 3))  # 3 of 3 items kept so far
    window = ChunksInFlight(5, sampler)
    window.add(PlannedChunk(1, range(3, 6)), "future-1")
    assert window.full()  # 3 items in flight may already make the 2 groups left: wait for them before drawing more


def test_the_committer_writes_stats_and_shard_and_counts_the_session(tmp_path):
    store = ShardStore(tmp_path)
    sampler = DynamicSampling(store, run_id=RUN, producer=PRODUCER, chunk_items=3, total_items=6)

    class Backpressure:
        committed = 0

    backpressure = Backpressure()
    committer = committer_for(store, sampler, flow_run_id="run-1", backpressure=backpressure)
    assert committer.commit(0, grouped_chunk(0, 3)) == []
    assert committer.commit(1, grouped_chunk(3, 3, started_at=11.0)) == []
    assert store.count(RUN) == 6 and backpressure.committed == 6
    stats = json.loads((store.run_dir(RUN) / chunk_stats_name(PRODUCER, 1)).read_text())
    assert stats["chunk"] == 1 and stats["groups_kept"] == 3 and stats["flow_run_id"] == "run-1"
    assert committer.session["chunks"] == 2 and committer.session["groups_kept"] == 6
    assert committer.session["rollouts"] == 12 and committer.session["generate_ms"] == 4000
    assert covered(committer.intervals) == 3.0  # [10, 12] and [11, 13] overlap


def test_a_chunk_past_the_target_is_thrown_away_uncommitted(tmp_path):
    store = ShardStore(tmp_path)
    sampler = DynamicSampling(store, run_id=RUN, producer=PRODUCER, chunk_items=3, total_items=1, target_groups=2)
    committer = committer_for(store, sampler)
    assert committer.commit(0, grouped_chunk(0, 3)) == []  # trimmed to the 2 groups the target needs
    assert committer.commit(1, grouped_chunk(3, 3)) is None
    assert store.count(RUN) == 2 and sorted(r.chunk for r in store.committed(RUN).values()) == [0]
    assert committer.session["chunks"] == 1 and len(committer.intervals) == 2


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module if node.module != "flows" else f"flows.{node.names[0].name}")
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_datagen_modules_import_downward_only():
    for path in (REPO / "factory/datagen").glob("*.py"):
        assert not {m for m in imports_of(path) if m.startswith("flows")}, path
    assert not {m for m in imports_of(REPO / "flows/datagen_cli.py") if m.startswith("flows.datagen")}


def test_the_progress_throttle_sends_the_first_report_then_at_most_one_per_interval():
    from factory.datagen.run import Throttle

    now = [100.0]
    throttle = Throttle(5.0, clock=lambda: now[0])
    assert throttle.due()  # the first chunk's report goes out at once
    now[0] += 1.0
    assert not throttle.due()  # held back ...
    assert throttle.held_back() and not throttle.held_back()  # ... and said once, for the final report
    now[0] += 4.0
    assert throttle.due() and not throttle.held_back()
    now[0] += 0.5
    assert not throttle.due()
    now[0] += 5.0
    assert throttle.due() and not throttle.held_back()  # a report sent after the held one clears it


def test_the_datagen_tasks_hash_no_inputs_for_a_cache_key():
    """Prefect's default cache policy cloudpickles a task's inputs (a whole chunk of groups) for a key nobody reads."""
    from prefect.cache_policies import NO_CACHE

    from tasks.rollout import rollout_task
    from tasks.shards import write_shard_task

    for task in (rollout_task, write_shard_task):
        assert task.cache_policy is NO_CACHE, task.name


def _run_committing(moves_by_chunk: dict[int, list], clock: list[float]):
    """A DatagenRun with only what `_commit` and the end of `outcome` touch: stubs that record what they were asked."""
    from types import SimpleNamespace

    from factory.datagen.run import DatagenRun, Throttle

    run = DatagenRun.__new__(DatagenRun)
    run.cfg = SimpleNamespace(datagen=SimpleNamespace(run_id="r", target_groups=None))
    run.env_name, run.progress_id, run.last_committed_chunk = "toy", "progress-1", None
    run.logger = SimpleNamespace(lines=[], info=lambda message, *args: run.logger.lines.append(message % args))
    run.committer = SimpleNamespace(commit=lambda chunk, grouped: moves_by_chunk.get(chunk, []))
    run.curriculum = SimpleNamespace(table=lambda: [{"family": "f", "level": 1}])
    run.sampler = SimpleNamespace(progress=lambda: 50.0)
    run.progress_throttle = Throttle(5.0, clock=lambda: clock[0])
    run.curriculum_throttle = Throttle(5.0, clock=lambda: clock[0])
    run.ops = SimpleNamespace(committed=[], chunk_committed=lambda **kw: run.ops.committed.append(kw))
    return run


def test_the_curriculum_table_is_published_on_a_level_move_else_at_most_every_interval_and_at_the_end(monkeypatch):
    import prefect.artifacts

    tables, progress = [], []
    monkeypatch.setattr(prefect.artifacts, "create_table_artifact",
                        lambda table, key, description: tables.append(description))
    monkeypatch.setattr(prefect.artifacts, "update_progress_artifact", lambda *args: progress.append(args))
    now = [100.0]
    move = {"family": "f", "from": 1, "to": 2, "pass_rate": 0.9}
    run = _run_committing({2: [move]}, now)
    grouped = grouped_chunk(0, 3)
    for chunk in range(4):  # 4 chunks within one interval: the first, and the one that moved a level
        run._commit(chunk, grouped)
        now[0] += 1.0
    assert tables == ["toy curriculum after chunk 0 of run r", "toy curriculum after chunk 2 of run r"]
    assert len(progress) == 1
    assert "curriculum: f level 1 -> 2 (recent pass rate 0.90)" in run.logger.lines
    now[0] += 5.0
    run._commit(4, grouped)  # the interval has passed
    assert tables[-1] == "toy curriculum after chunk 4 of run r"
    run._commit(5, grouped)  # held back: the end of the run publishes it
    assert tables[-1] == "toy curriculum after chunk 4 of run r"
    run.ops.progress = None
    run._send_held_back_reports()
    assert tables[-1] == "toy curriculum after chunk 5 of run r" and len(tables) == 4
    run._send_held_back_reports()
    assert len(tables) == 4  # nothing held back any more


def test_each_committed_chunk_is_one_progress_record_that_names_what_the_chunk_kept_and_dropped(monkeypatch):
    import prefect.artifacts

    from factory.datagen.ops import RunOps
    from factory.progress import PROGRESS_PREFIX

    monkeypatch.setattr(prefect.artifacts, "update_progress_artifact", lambda *args: None)
    run = _run_committing({}, [0.0])
    run.curriculum = None
    ops = RunOps.__new__(RunOps)
    ops.logger, ops.target_groups, ops._progress_artifact, ops.progress = run.logger, None, None, None
    ops.track("toy", total_chunks=10, done_before=0)
    run.ops = ops
    grouped = grouped_chunk(0, 3)
    before = len(run.logger.lines)
    run._commit(7, grouped)
    line, = run.logger.lines[before:]
    assert line.startswith(PROGRESS_PREFIX + "toy: 1/10 chunks, 3 groups kept, ")  # what `progress watch` prints
    assert line.endswith(f"(chunk 7: kept 3 groups, dropped {dict(grouped.dropped)})")


def test_a_committed_chunk_keeps_only_its_counts(monkeypatch):
    """The rollout task run's Prefect state holds its result until a garbage collection: once committed, that
    result must not hold the chunk's groups and items (they were left for the collector to walk, issue 33)."""
    import prefect.artifacts

    monkeypatch.setattr(prefect.artifacts, "update_progress_artifact", lambda *args: None)
    run = _run_committing({}, [0.0])
    run.curriculum = None
    grouped = grouped_chunk(0, 3)
    rows = grouped.to_record_batch().num_rows
    run._commit(0, grouped)
    assert rows == 3 and run.ops.committed[-1]["groups_kept"] == 3  # reported before the release
    assert len(grouped) == 0 and grouped.outcomes == [] and grouped.to_record_batch().num_rows == 0
    assert grouped.rollouts == 6 and grouped.stats()["rollouts"] == 6  # the counts stay


def test_a_throttle_told_a_report_was_sent_another_way_waits_a_whole_interval():
    from factory.datagen.run import Throttle

    now = [100.0]
    throttle = Throttle(5.0, clock=lambda: now[0])
    throttle.sent()  # e.g. the progress artifact was just created with the same figure
    now[0] += 4.0
    assert not throttle.due() and throttle.held_back()
    now[0] += 1.0
    assert throttle.due()


def _run_reporting(tmp_path, monkeypatch, now):
    """A run committing chunks whose progress artifact is not made yet, as DatagenRun.__init__ leaves it."""
    import prefect.artifacts

    from factory.datagen.run import Throttle

    calls = []
    monkeypatch.setattr(prefect.artifacts, "update_progress_artifact", lambda *args: calls.append(("update",) + args))
    run = _run_committing({}, now)
    run.curriculum, run.progress_id = None, None
    run.cfg.datagen.chunk_items = 4
    run.store = ShardStore(tmp_path)
    run.ops.progress = None
    run.ops.progress_artifact = lambda progress, *, key, description: calls.append(("create", progress, key)) or "a1"
    run.progress_throttle = Throttle(5.0, clock=lambda: now[0])
    run.progress_throttle.sent()
    return run, calls


def test_a_run_shorter_than_the_interval_makes_its_progress_artifact_once_at_the_end(tmp_path, monkeypatch):
    """One API call instead of create at the start, update at the first chunk and update at the end."""
    now = [100.0]
    run, calls = _run_reporting(tmp_path, monkeypatch, now)
    for chunk in range(4):
        run._commit(chunk, grouped_chunk(0, 3))
        now[0] += 1.0
    assert calls == []
    run._send_held_back_reports()
    assert calls == [("create", 50.0, "r-progress")] and run.progress_id == "a1"
    run._send_held_back_reports()
    assert len(calls) == 1


def test_a_longer_run_makes_its_progress_artifact_at_the_first_report_due_then_updates_it(tmp_path, monkeypatch):
    now = [100.0]
    run, calls = _run_reporting(tmp_path, monkeypatch, now)
    now[0] += 6.0
    run._commit(0, grouped_chunk(0, 3))
    assert calls == [("create", 50.0, "r-progress")]
    now[0] += 1.0
    run._commit(1, grouped_chunk(0, 3))  # within the interval: held back
    now[0] += 5.0
    run._commit(2, grouped_chunk(0, 3))
    run._commit(3, grouped_chunk(0, 3))  # held back again
    run._send_held_back_reports()
    assert calls[1:] == [("update", "a1", 50.0), ("update", "a1", 50.0)]


def test_a_progress_artifact_that_failed_to_be_made_is_made_with_the_next_report(tmp_path, monkeypatch):
    now = [100.0]
    run, calls = _run_reporting(tmp_path, monkeypatch, now)
    run.ops.progress_artifact = lambda progress, *, key, description: None  # best_effort's answer in an outage
    now[0] += 6.0
    run._commit(0, grouped_chunk(0, 3))
    assert run.progress_id is None
    run.ops.progress_artifact = lambda progress, *, key, description: calls.append(("create", progress)) or "a2"
    run._send_held_back_reports()
    assert calls == [("create", 50.0)] and run.progress_id == "a2"
