"""Dynamic sampling without Prefect: the flow's chunk loop over real InternBootcamp items and a scripted policy.

The policy is a pure function of the item key, so an uninterrupted run and a run killed mid-way and resumed
must commit exactly the same items, reach exactly the target, and end with the same curriculum state.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from environments.base import Rollout
from environments.bootcamp_tasks import parse_key
from environments.intern_bootcamp import InternBootcampConfig, InternBootcampEnv
from factory.chunk_stats import Folder, Restore, fold, read_all
from factory.curriculum import CurriculumSettings
from factory.datagen.run import ChunkCommitter, ChunksInFlight, PlannedChunk
from factory.run_outcome import target_missed_message
from factory.sampling import DynamicSampling, curriculum_state_name, make_curriculum
from factory.store import ShardStore
from tasks.group import group_chunk

RUN, PRODUCER = "dyn", "ib"
PASS_BY_LEVEL = {1: 0.97, 2: 0.8, 3: 0.5, 4: 0.15, 5: 0.0}


class Killed(Exception):
    pass


def tmp_root(store):
    return store.run_dir(RUN).parent


def scripted_rollouts(item, group_size: int, pass_by_level) -> list[Rollout]:
    _, level, _ = parse_key(item.key)
    out = []
    for j in range(group_size):
        u = int(hashlib.sha256(f"{item.key}:{j}".encode()).hexdigest()[:8], 16) / 2**32
        score = 1.0 if u < pass_by_level[level] else -0.5
        out.append(Rollout(item.key, "t", [1, 2], [3, 4], [-0.1, -0.1], "stop", 0, score=score))
    return out


def run_loop(store, *, target=None, total_items=40, max_items=None, chunk_items=5, lag=2, curriculum=True,
             kill_after=None, pass_by_level=PASS_BY_LEVEL, group_size=4, fold_chunks=None):
    """The datagen flow's loop (flows/datagen.py, DatagenRun) on its own window and committer, the Prefect
    tasks replaced by direct calls."""
    env = InternBootcampEnv(InternBootcampConfig(difficulties=[3], group_size=group_size))
    cur = make_curriculum(CurriculumSettings(enabled=curriculum, min_items=4), env, start_level=3)
    found = Restore(store.run_dir(RUN), PRODUCER)  # as DatagenRun: one read for the sampler and the folder
    s = DynamicSampling(store, run_id=RUN, producer=PRODUCER, chunk_items=chunk_items, total_items=total_items,
                        target_groups=target, max_items=max_items, chunks_in_flight=lag, curriculum=cur,
                        solved=env.solved, chunk_stats=found)
    window = ChunksInFlight(lag, s)
    folder = None if fold_chunks is None else Folder(store, RUN, PRODUCER, found, s.committed_chunks,
                                                     threshold=fold_chunks)
    committer = ChunkCommitter(store, root=str(tmp_root(store)), run_id=RUN, producer=PRODUCER, sampler=s,
                               write_shard=lambda _root, run, producer, chunk, groups: store.commit(run, producer,
                                                                                                   chunk, groups),
                               folder=folder)
    commits = 0

    def draw(planned):
        items = [env.get_item(i) if planned.plan is None else env.get_planned_item(i, planned.plan)
                 for i in planned.indices]
        return group_chunk("intern_bootcamp", items, [scripted_rollouts(i, group_size, pass_by_level) for i in items],
                           group_size=group_size, max_token_length=100, run_id=RUN)

    def commit_oldest():
        nonlocal commits
        planned, grouped = window.pop()
        if committer.commit(planned.chunk, grouped) is None:
            return
        commits += 1
        if kill_after is not None and commits >= kill_after:
            raise Killed

    while True:
        while window.full():
            commit_oldest()
        chunk = s.next_chunk()
        if chunk is None:
            break
        planned = PlannedChunk(chunk, s.indices(chunk), s.plan_for(chunk))
        window.add(planned, draw(planned))
    while window:
        commit_oldest()
    return s


def committed_keys(store):
    return [g.item_key for g in store.iter_groups(RUN)]


def test_fixed_mode_draws_total_items_in_chunks_as_before(tmp_path):
    store = ShardStore(tmp_path)
    s = run_loop(store, total_items=12, chunk_items=5, curriculum=False)
    assert sorted(r.chunk for r in store.committed(RUN).values()) == [0, 1, 2]
    assert s.summary()["items_tried"] == 12 and s.stop_reason() == "total_items"
    assert list(s.indices(2)) == [10, 11]


@pytest.mark.parametrize("lag", [1, 2])
def test_target_is_reached_exactly_and_a_killed_run_resumes_to_the_same_items_and_curriculum(tmp_path, lag):
    whole = ShardStore(tmp_path / "whole")
    s = run_loop(whole, target=37, lag=lag)
    assert whole.count(RUN) == 37 and s.stop_reason() == "target_groups"
    assert s.summary()["trimmed_over_target"] >= 0
    keys = committed_keys(whole)
    assert len(set(keys)) == 37

    killed = ShardStore(tmp_path / "killed")
    with pytest.raises(Killed):
        run_loop(killed, target=37, lag=lag, kill_after=3)
    assert killed.count(RUN) < 37
    with pytest.raises(Killed):  # killed again, one chunk later
        run_loop(killed, target=37, lag=lag, kill_after=1)
    resumed = run_loop(killed, target=37, lag=lag)
    assert killed.count(RUN) == 37 and committed_keys(killed) == keys  # no duplicates, no gaps, same items
    assert resumed.restored_chunks == 4
    state = lambda store: json.loads((store.run_dir(RUN) / curriculum_state_name(PRODUCER)).read_text())  # noqa: E731
    assert state(killed) == state(whole)
    assert {g.difficulty for g in killed.iter_groups(RUN)} <= {1, 2, 3, 4, 5}
    again = run_loop(killed, target=37, lag=lag)  # a finished run draws nothing more
    assert again.next_chunk() is None and killed.count(RUN) == 37


def test_a_run_resumed_from_folded_stats_restores_the_same_items_and_curriculum(tmp_path):
    whole = ShardStore(tmp_path / "whole")
    s = run_loop(whole, target=37, lag=2)
    keys = committed_keys(whole)
    folded = ShardStore(tmp_path / "folded")
    with pytest.raises(Killed):
        run_loop(folded, target=37, lag=2, kill_after=5, fold_chunks=2)
    segments = [n for n in os.listdir(folded.run_dir(RUN)) if ".chunks-" in n]
    assert len(segments) == 2  # chunks 0-3 folded, chunk 4 in its own file
    resumed = run_loop(folded, target=37, lag=2, fold_chunks=2)
    assert resumed.restored_chunks == 5 and committed_keys(folded) == keys
    state = lambda store: json.loads((store.run_dir(RUN) / curriculum_state_name(PRODUCER)).read_text())  # noqa: E731
    assert state(folded) == state(whole)
    assert resumed.summary() == s.summary()

    # the whole run's stats folded in one go: a restore reads the same as from its per-chunk files
    copy = ShardStore(tmp_path / "copy")
    shutil.copytree(whole.run_dir(RUN), copy.run_dir(RUN))
    chunks = {c: stats for (_, c), stats in read_all(copy, RUN, PRODUCER).items()}
    fold(copy, RUN, PRODUCER, chunks)
    assert not [n for n in os.listdir(copy.run_dir(RUN)) if n.startswith(f"stats-{PRODUCER}-")]

    def restore(store):
        env = InternBootcampEnv(InternBootcampConfig(difficulties=[3], group_size=4))
        cur = make_curriculum(CurriculumSettings(enabled=True, min_items=4), env, start_level=3)
        r = DynamicSampling(store, run_id=RUN, producer=PRODUCER, chunk_items=5, total_items=40, target_groups=37,
                            chunks_in_flight=2, curriculum=cur, solved=env.solved)
        return r.committed_items, r.trimmed_total(), cur.to_dict(), r._plans, r.summary()

    assert restore(copy) == restore(whole)


def test_curriculum_moves_levels_toward_the_band_and_groups_record_their_level(tmp_path):
    store = ShardStore(tmp_path)
    easy = {1: 1.0, 2: 1.0, 3: 1.0, 4: 0.5, 5: 0.5}
    s = run_loop(store, target=60, chunk_items=14, pass_by_level=easy)
    levels = s.curriculum.levels()
    assert min(levels.values()) >= 4, levels  # every family climbed out of the always-solved levels
    by_level = {g.difficulty for g in store.iter_groups(RUN)}
    assert by_level <= {3, 4, 5} and by_level & {4, 5}


def test_hopeless_run_stops_at_max_items_with_a_clear_message(tmp_path):
    store = ShardStore(tmp_path)
    never = {level: 0.0 for level in range(1, 6)}
    s = run_loop(store, target=5, max_items=23, pass_by_level=never, curriculum=False)
    assert store.count(RUN) == 0 and s.stop_reason() == "max_items"
    assert s.summary()["items_tried"] == 23
    message = target_missed_message({**s.summary(), "groups_kept": store.count(RUN), "rollouts": 0, "dropped": {}})
    assert "datagen.max_items=23" in message and "kept 0 of datagen.target_groups=5" in message


def test_default_item_cap_is_ten_items_per_target_group(tmp_path):
    s = DynamicSampling(ShardStore(tmp_path), run_id=RUN, producer=PRODUCER, chunk_items=7, total_items=1,
                        target_groups=3)
    assert s.max_items == 30 and s.n_chunks == 5 and list(s.indices(4)) == [28, 29]


def test_curriculum_on_an_env_without_difficulty_levels_is_refused():
    from environments.base import BaseEnv

    with pytest.raises(ValueError, match="has none"):
        make_curriculum(CurriculumSettings(enabled=True), BaseEnv())


def test_a_plan_equal_to_the_static_config_draws_the_same_items():
    env = InternBootcampEnv(InternBootcampConfig(difficulties=[2], seed=7))
    plan = {"levels": {name: 2 for name in env.curriculum_families()}, "weights": env.base_weights()}
    assert [env.get_planned_item(i, plan).key for i in range(30)] == [env.get_item(i).key for i in range(30)]
    harder = {"levels": {name: 4 for name in env.curriculum_families()}, "weights": env.base_weights()}
    assert all(env.get_planned_item(i, harder).info["difficulty"] == 4 for i in range(30))


def test_config_keys_from_yaml_and_dotted_cli():
    from factory.config import ConfigError
    from flows.datagen import ENVIRONMENTS, build_job_config

    cfg = build_job_config(ENVIRONMENTS["intern_bootcamp"], config_path="deployments/intern_bootcamp.yaml",
                           cli_args=["--datagen.target_groups", "50", "--datagen.curriculum.enabled", "true",
                                     "--datagen.curriculum.low", "0.3"])
    assert cfg.datagen.target_groups == 50 and cfg.datagen.max_items is None
    assert cfg.datagen.curriculum.enabled and cfg.datagen.curriculum.low == 0.3 and cfg.datagen.curriculum.high == 0.8
    with pytest.raises(ConfigError, match="band is empty"):
        build_job_config(ENVIRONMENTS["intern_bootcamp"], cli_args=["--datagen.curriculum.low", "0.9",
                                                                    "--datagen.curriculum.high", "0.5"])


def test_state_file_one_chunk_behind_is_rewritten_from_the_committed_chunks(tmp_path):
    store = ShardStore(tmp_path)
    run_loop(store, target=20)
    path = store.run_dir(RUN) / curriculum_state_name(PRODUCER)
    good = path.read_text()
    path.write_text(json.dumps({"stale": True}))  # as if killed between the last commit and the state write
    again = run_loop(store, target=20)
    assert again.next_chunk() is None and path.read_text() == good
