"""Folding of per-chunk stats files into write-once segments (factory/chunk_stats.py), without Prefect: what every
reader sees is the same before folding, after it, and after a kill between a segment's write and its files'
deletion; the committer folds every `threshold` commits; clean-up at start-up keeps segments."""

from __future__ import annotations

import json
import os
from collections import Counter
from types import SimpleNamespace

import pytest

from factory import chunk_stats
from factory.chunk_stats import Folder, Restore, chunk_stats_name, parse_name, read_all, segment_name, write_segment
from factory.datagen.summary import summarize
from factory.run_outcome import clean_start
from factory.sampling import DynamicSampling
from factory.store import ShardStore
from tests.unit.datagen.test_run_parts import PRODUCER, RUN, committer_for, grouped_chunk


def stats_of(chunk: int, producer: str = PRODUCER) -> dict:
    return {"groups_kept": 2 + chunk % 3, "rollouts": 8, "completion_tokens": 40 + chunk, "scored": 8,
            "score_sum": 0.5 * chunk, "dropped": {"failed": chunk % 2, "equal_scores": 1}, "chunk": chunk,
            "items": 4, "trimmed_over_target": 0, "flow_run_id": f"flow-{chunk // 3}"}


def write_files(store: ShardStore, chunks, producer: str = PRODUCER) -> None:
    for chunk in chunks:
        store.write_run_file(RUN, chunk_stats_name(producer, chunk), json.dumps(stats_of(chunk, producer)))


def names(store: ShardStore) -> list[str]:
    return sorted(n for n in os.listdir(store.run_dir(RUN)) if n.startswith("stats-"))


def summary_of(store: ShardStore) -> dict:
    cfg = SimpleNamespace(datagen=SimpleNamespace(run_id=RUN, producer=PRODUCER))
    out = summarize(store, cfg, 1.0, Counter(), [])
    out.pop("store")
    return out


def test_names_are_told_apart():
    assert parse_name(chunk_stats_name("ib-2", 7)) == ("chunk", "ib-2", 7)
    assert parse_name(segment_name("ib-2", 0, 255)) == ("segment", "ib-2", 0)
    assert parse_name("stats-ib-2.json") == ("run", "ib-2", -1)
    assert parse_name("config-ib.yaml") is None and parse_name(".stats-ib-00000001.json.0123.tmp") is None


def test_a_fold_writes_one_segment_deletes_the_files_and_reads_the_same(tmp_path):
    store = ShardStore(tmp_path)
    write_files(store, range(5))
    write_files(store, range(3), producer="other")
    before = read_all(store, RUN)
    assert len(before) == 8 and before[(PRODUCER, 4)] == stats_of(4)
    name, failed = chunk_stats.fold(store, RUN, PRODUCER, {c: stats_of(c) for c in range(4)})
    assert name == segment_name(PRODUCER, 0, 3) and failed == []
    assert names(store) == sorted([name, chunk_stats_name(PRODUCER, 4)] + [chunk_stats_name("other", c)
                                                                           for c in range(3)])
    assert read_all(store, RUN) == before
    assert read_all(store, RUN, PRODUCER) == {k: v for k, v in before.items() if k[0] == PRODUCER}
    totals = json.loads((store.run_dir(RUN) / name).read_text())["totals"]
    assert totals["chunks"] == 4 and totals["groups_kept"] == 2 + 3 + 4 + 2 and totals["score_sum"] == 3.0
    assert totals["dropped"] == {"failed": 2, "equal_scores": 4} and totals["flow_runs"] == {"flow-0": 3, "flow-1": 1}


def test_a_kill_between_the_segment_and_the_deletion_counts_each_chunk_once(tmp_path):
    store = ShardStore(tmp_path)
    for chunk in range(6):
        write_files(store, [chunk])
        store.commit(RUN, PRODUCER, chunk, grouped_chunk(chunk * 3, 3).groups)
    before_summary = summary_of(store)
    before = read_all(store, RUN)
    name = write_segment(store, RUN, PRODUCER, {c: stats_of(c) for c in range(4)})  # killed here: files still there
    assert len(names(store)) == 7
    segment = json.loads((store.run_dir(RUN) / name).read_text())
    assert segment["chunks"]["2"] == (store.run_dir(RUN) / chunk_stats_name(PRODUCER, 2)).read_text()  # verbatim
    assert read_all(store, RUN) == before and summary_of(store) == before_summary
    start = Restore(store.run_dir(RUN), PRODUCER)
    folder = Folder(store, RUN, PRODUCER, start, committed=set(range(6)), threshold=3)
    assert sorted(folder.unfolded) == [4, 5] and len(folder.leftovers) == 4
    assert folder.fold_if_due() is None  # nothing due, but the leftovers go
    assert names(store) == [chunk_stats_name(PRODUCER, 4), chunk_stats_name(PRODUCER, 5),
                            segment_name(PRODUCER, 0, 3)]
    assert read_all(store, RUN) == before and summary_of(store) == before_summary


def test_the_committer_folds_every_threshold_commits_and_the_summary_stays(tmp_path, monkeypatch):
    plain, folding = ShardStore(tmp_path / "plain"), ShardStore(tmp_path / "folding")
    for store, threshold in ((plain, None), (folding, 3)):
        found = Restore(store.run_dir(RUN), PRODUCER)
        sampler = DynamicSampling(store, run_id=RUN, producer=PRODUCER, chunk_items=3, total_items=24,
                                  chunk_stats=found)
        folder = None if threshold is None else Folder(store, RUN, PRODUCER, found,
                                                       sampler.committed_chunks, threshold=threshold)
        committer = committer_for(store, sampler, flow_run_id="run-1", folder=folder)
        for chunk in range(8):
            committer.commit(chunk, grouped_chunk(chunk * 3, 3))
    assert names(folding) == sorted([segment_name(PRODUCER, 0, 2), segment_name(PRODUCER, 3, 5),
                                     chunk_stats_name(PRODUCER, 6), chunk_stats_name(PRODUCER, 7)])
    assert len(names(plain)) == 8
    assert read_all(folding, RUN) == read_all(plain, RUN)
    assert summary_of(folding) == summary_of(plain) and summary_of(plain)["chunks_committed"] == 8
    restored = [DynamicSampling(store, run_id=RUN, producer=PRODUCER, chunk_items=3, total_items=30)
                for store in (plain, folding)]
    assert [(s.committed_items, s.committed_groups, s.trimmed_total(), s.todo_chunks()) for s in restored] == \
        [(24, 24, 0, 2)] * 2


def test_a_failed_segment_write_keeps_the_files_and_is_retried(tmp_path, monkeypatch):
    store = ShardStore(tmp_path)
    write_files(store, range(3))
    folder = Folder(store, RUN, PRODUCER, Restore(store.run_dir(RUN), PRODUCER), committed={0, 1}, threshold=3)
    assert sorted(folder.unfolded) == [0, 1]  # chunk 2 is not committed: never folded
    real = store.write_run_file

    def full_disk(run_id, name, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "write_run_file", full_disk)
    assert folder.committed(2, stats_of(2)) is None
    assert len(names(store)) == 3 and sorted(folder.unfolded) == [0, 1, 2]
    monkeypatch.setattr(store, "write_run_file", real)
    write_files(store, [3])
    assert folder.committed(3, stats_of(3)) == segment_name(PRODUCER, 0, 3)
    assert names(store) == [segment_name(PRODUCER, 0, 3)]


def test_clean_start_keeps_segments_and_removes_their_temporary_files(tmp_path):
    store = ShardStore(tmp_path)
    store.commit(RUN, PRODUCER, 0, grouped_chunk(0, 3).groups)
    write_files(store, [0, 1])  # chunk 1 was never committed
    write_segment(store, RUN, PRODUCER, {0: stats_of(0)})
    run_dir = store.run_dir(RUN)
    (run_dir / f".{segment_name(PRODUCER, 4, 9)}.0123456789ab.tmp").write_text("{")  # killed mid-write
    (run_dir / f".{segment_name('other', 4, 9)}.0123456789ab.tmp").write_text("{")  # another producer's
    removed = clean_start(store, RUN, PRODUCER)
    assert sorted(removed) == [f".{segment_name(PRODUCER, 4, 9)}.0123456789ab.tmp", chunk_stats_name(PRODUCER, 1)]
    assert segment_name(PRODUCER, 0, 0) in names(store)


def test_an_unreadable_segment_stops_a_resume_rather_than_forget_its_chunks(tmp_path):
    store = ShardStore(tmp_path)
    store.write_run_file(RUN, segment_name(PRODUCER, 0, 255), "{not json")
    with pytest.raises(ValueError):
        read_all(store, RUN, PRODUCER)
    with pytest.raises(ValueError):
        DynamicSampling(store, run_id=RUN, producer=PRODUCER, chunk_items=3, total_items=24)
    assert read_all(store, RUN, "other") == {}


def test_the_summary_counts_a_chunk_once_also_when_segments_overlap_or_hold_an_uncommitted_chunk(tmp_path):
    store = ShardStore(tmp_path)
    for chunk in range(5):
        store.commit(RUN, PRODUCER, chunk, grouped_chunk(chunk * 3, 3).groups)
    write_files(store, range(5))
    expected = summary_of(store)
    write_segment(store, RUN, PRODUCER, {c: stats_of(c) for c in range(3)})
    write_segment(store, RUN, PRODUCER, {c: stats_of(c) for c in (2, 3, 7)})  # 2 twice, 7 never committed
    assert summary_of(store) == expected
    for chunk in range(4):
        (store.run_dir(RUN) / chunk_stats_name(PRODUCER, chunk)).unlink()
    assert summary_of(store) == expected and expected["groups_kept"] == sum(stats_of(c)["groups_kept"]
                                                                            for c in range(5))


def test_a_resume_replays_committed_chunks_in_chunk_order_whatever_order_the_stats_come_in(tmp_path, monkeypatch):
    store = ShardStore(tmp_path)
    for chunk in range(6):
        store.commit(RUN, PRODUCER, chunk, grouped_chunk(chunk * 3, 3).groups)
    write_files(store, [2, 5])  # 2 committed late (after chunks 0-4 were folded without it), 5 not folded yet
    write_segment(store, RUN, PRODUCER, {c: stats_of(c) for c in (0, 1, 3, 4)})
    replayed = []
    monkeypatch.setattr(DynamicSampling, "_replay", lambda self, chunk, stats: replayed.append((chunk, stats)))
    restore = Restore(store.run_dir(RUN), PRODUCER)
    DynamicSampling(store, run_id=RUN, producer=PRODUCER, chunk_items=3, total_items=30, chunk_stats=restore)
    assert replayed == [(c, stats_of(c)) for c in range(6)]
    assert restore.folded == {0, 1, 3, 4} and sorted(restore.unfolded) == [2, 5]
