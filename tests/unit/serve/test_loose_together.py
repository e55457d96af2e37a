"""run-api takes the uncompacted shards of a manifest's `Loose` runs as columns (issue 34, start-up before
compaction): a fresh start-up's scan hands them out as `NewShards` stretches and a restart locates them as
`OwnStretch`es, and both index, locate and queue exactly what the shard-by-shard path does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import factory.serve.follower as follower
import factory.store as store_module
from bench.shards.startup_ab import queue_digest
from factory.serve.config import ServeConfig
from factory.serve.follower import Locator, NewShards, scan_new_shards
from factory.serve.service import BatchService
from factory.store import ShardStore
from factory.store_compact import checkpoint
from factory.synthetic import synthetic_groups


@pytest.fixture(autouse=True)
def _short_runs(monkeypatch):
    monkeypatch.setattr(store_module, "LOOSE_MIN", 4)  # runs this short become a Loose here
    monkeypatch.setattr(follower, "LIST_AT", 5)  # the listing, not a size look each, after 4 shards


def _store(root: Path, chunks: int = 30) -> ShardStore:
    store = ShardStore(root)
    for chunk in range(chunks):
        for producer in ("w0", "w1"):
            store.commit("gen", producer, chunk, synthetic_groups(3, start=chunk * 10 + (producer == "w1") * 5000,
                                                                  group_size=2, seq_len=8))
    checkpoint(store, "gen")
    return store


def _flat(found):
    """(shard, rows, path, index rows) of each shard found, a `NewShards` member by member."""
    out = []
    for item in found:
        for shard in item.members() if type(item) is NewShards else [item]:
            out.append((shard.shard, shard.rows, str(shard.path), shard.index.to_pylist()))
    return out


def test_a_scan_takes_loose_members_together_as_it_takes_them_one_by_one(tmp_path):
    _store(tmp_path)
    store = ShardStore(tmp_path)
    assert any(type(item).__name__ == "Loose" for item in store._read_log("gen").records.items_in_order())
    (tmp_path / "gen" / "shards" / "w1-00000010.parquet").unlink()  # gone: reported, not taken
    want_reported, got_reported = set(), set()
    want = scan_new_shards(ShardStore(tmp_path), ["gen"], set(), want_reported)
    got = scan_new_shards(ShardStore(tmp_path), ["gen"], set(), got_reported, together=True)
    assert any(type(item) is NewShards for item in got) and len(_flat(got)) == 59
    assert _flat(got) == _flat(want) and got_reported == want_reported and len(want_reported) == 1
    known = {("gen", shard) for shard, *_ in _flat(want)[::3]}  # some known: the others, in order
    assert _flat(scan_new_shards(ShardStore(tmp_path), ["gen"], known, set(), together=True)) == _flat(
        scan_new_shards(ShardStore(tmp_path), ["gen"], known, set()))


def test_own_stretches_find_what_own_file_finds(tmp_path):
    _store(tmp_path)
    (tmp_path / "gen" / "shards" / "w0-00000020.parquet").unlink()
    store = ShardStore(tmp_path)
    names = [record.shard for record in ShardStore(tmp_path).changes("gen")[1]]
    assert len(names) == 60
    sources = [(i + 1 + (i >= 30) * 5, "gen", name, 3) for i, name in enumerate(names)]  # a gap in the ids
    sources[7] = (8, "gen", sources[7][2], 2)  # rows not its record's: not its own file's (as own_file says)
    locator, one_by_one = Locator(store), Locator(ShardStore(tmp_path))
    stretches = locator.own_stretches(sources, least=2)
    assert stretches and sum(s.stop - s.start for s in stretches) == 60 - 2
    covered = set()
    for stretch in stretches:
        ids = [s[0] for s in sources[stretch.start:stretch.stop]]
        assert ids == list(range(stretch.first, stretch.first + len(stretch.shards)))
        for at, path, rows, summary in zip(range(stretch.start, stretch.stop), stretch.paths, stretch.rows.tolist(),
                                           stretch.summaries):
            source, run_id, shard, want_rows = sources[at]
            assert stretch.shards[at - stretch.start] == shard and rows == want_rows
            assert one_by_one.own_file(run_id, shard, want_rows) == (path, summary)
            covered.add(at)
    for at, (source, run_id, shard, rows) in enumerate(sources):
        if at not in covered:
            assert one_by_one.own_file(run_id, shard, rows) is None


def _start(root: Path, state: Path, one_by_one: bool, monkeypatch) -> tuple[str, dict, int]:
    with monkeypatch.context() as patch:
        scan, stretches = follower.scan_new_shards, Locator.own_stretches
        if one_by_one:  # the shard-by-shard path: no NewShards, no OwnStretch
            patch.setattr(Locator, "own_stretches", lambda self, sources, least=64: [])
            patch.setattr(follower, "scan_new_shards", lambda *args, together=False, **kwargs: scan(*args, **kwargs))
        else:  # the column path is taken
            def together(*args, **kwargs):
                found = scan(*args, **kwargs)
                assert not found or any(type(item) is NewShards for item in found)
                return found

            def own_stretches(self, sources, least=64):
                got = stretches(self, sources, least)
                assert sum(len(stretch.shards) for stretch in got) == len(sources)
                return got

            patch.setattr(follower, "scan_new_shards", together)
            patch.setattr(Locator, "own_stretches", own_stretches)

        async def run():
            service = BatchService(ServeConfig(store_root=str(root), follow_runs=["gen"], follow_interval_s=3600,
                                               state_path=str(state), batch_metadata=False))
            await service.start()
            got = (queue_digest(service.queue), dict(service.sources), service.queue.groups,
                   dict(service._source_ids), set(service._known))
            await service.stop()
            return got

        return asyncio.run(run())


@pytest.mark.parametrize("restart", [False, True])
def test_a_start_up_queues_and_indexes_as_shard_by_shard(tmp_path, monkeypatch, restart):
    import shutil
    import sqlite3

    _store(tmp_path / "store", 200)
    states = {}
    for one_by_one in (True, False):
        state = tmp_path / f"state-{one_by_one}.db"
        if restart:  # indexed by a first start-up, some groups taken (all of some shards)
            _start(tmp_path / "store", state, True, monkeypatch)
            db = sqlite3.connect(state)
            with db:
                db.executemany("INSERT OR REPLACE INTO taken (source, row, step, pos, epoch) VALUES (?, ?, ?, ?, 0)",
                               [(source, row, 1, 0) for source in range(3, 400, 7)
                                for row in range(3 if source % 2 else 1)])
            db.close()
        states[one_by_one] = _start(tmp_path / "store", state, one_by_one, monkeypatch)
        shutil.copy(state, tmp_path / f"kept-{one_by_one}.db")
    assert states[False] == states[True]
    assert states[False][2] == 1200 - (3 * 29 + 28 if restart else 0)
    tables = [sqlite3.connect(tmp_path / f"kept-{flag}.db").execute("SELECT * FROM sources ORDER BY source_id")
              .fetchall() for flag in (True, False)]
    assert tables[0] == tables[1] and len(tables[0]) == 400
