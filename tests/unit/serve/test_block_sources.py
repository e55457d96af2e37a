"""run-api indexes the members of a compacted file that a manifest holds as a block as one source block (a row of
the served state, not one per member), and serves every group once across restarts and compactions."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from factory.serve.config import ServeConfig
from factory.serve.follower import NewBlock, NewShard, scan_new_shards
from factory.serve.service import BatchService
from factory.serve.state import BlockRows, ServedState
from factory.store import ShardStore
from factory.store_compact import checkpoint, compact_run
from factory.synthetic import synthetic_groups
from tests.unit.serve.test_queue_blocks import REGISTRATION
from tests.unit.serve.test_service import batch_ids


def _commit(store: ShardStore, groups: list, chunks: range) -> None:
    for chunk in chunks:
        store.commit("gen", "w0", chunk, groups[chunk * 10:(chunk + 1) * 10])


def _groups(count: int) -> list:
    groups = list(synthetic_groups(count, group_size=2, seq_len=8))
    for number, group in enumerate(groups):
        group.env, group.env_id = ("a", 0) if number % 3 else ("b", None)
    return groups


def _life(cfg: ServeConfig, batches: int | None, seen: dict | None = None) -> list[str]:
    async def run() -> list[str]:
        service = BatchService(cfg)
        await service.start()
        if seen is not None:
            seen.update(sources=len(service.sources), blocks=len(service._block_firsts), queued=service.queue.groups)
        if service.registration is None:
            await service.register(REGISTRATION)
        served: list[str] = []
        while batches is None or len(served) < batches * 8:
            got = batch_ids((await service.next_batch(False)).raw)
            if not got:
                break
            served += got
        await service.stop()
        return served

    return asyncio.run(run())


def test_a_fresh_start_indexes_a_compacted_file_as_one_block_and_serves_each_group_once(tmp_path):
    store = ShardStore(tmp_path)
    groups = _groups(240)
    _commit(store, groups, range(12))
    compact_run(store, "gen", target_bytes=1 << 30)
    checkpoint(store, "gen")
    cfg = ServeConfig(store_root=str(tmp_path), follow_interval_s=0.05, follow_runs=["gen"], batch_metadata=True)
    seen: dict = {}
    served = _life(cfg, 3, seen)
    assert seen == {"sources": 0, "blocks": 1, "queued": 120}
    state = ServedState(cfg.resolved_state_path())
    assert state.sources() == [] and [b[2] for b in state.source_blocks()] == [store._read_log("gen").files.popitem()[0]]
    state.close()
    served += _life(cfg, 2, seen)  # a restart: the block from the served state, its taken rows left out
    assert seen == {"sources": 0, "blocks": 1, "queued": 120 - 24}
    _commit(store, groups, range(12, 18))  # new shards, indexed one by one
    served += _life(cfg, 1, seen)
    assert seen["sources"] == 6 and seen["blocks"] == 1
    compact_run(ShardStore(tmp_path), "gen", target_bytes=1 << 30)  # merges the six, known one by one
    checkpoint(ShardStore(tmp_path), "gen")
    _commit(store, groups, range(18, 24))
    compact_run(ShardStore(tmp_path), "gen", target_bytes=1 << 30)  # and six never indexed: a new block
    checkpoint(ShardStore(tmp_path), "gen")
    served += _life(cfg, None, seen)
    assert seen["sources"] == 0 and seen["blocks"] == 3  # the six known one by one folded into a block
    assert len(served) == len(set(served)) == 240 and set(served) == {g.group_id for g in groups}


@pytest.mark.parametrize("save_manifest,by_columns", [(False, True), (True, True), (True, False)])
def test_shards_indexed_one_by_one_then_compacted_are_folded_into_a_block(tmp_path, monkeypatch, save_manifest,
                                                                          by_columns):
    """A service that indexed shards as they came restarts after they were compacted: it folds them into one block
    (same source ids, so the groups it served stay served) and the restart after that loads the block."""
    if not by_columns:
        monkeypatch.setattr(ServedState, "source_columns", lambda self, runs=None: None)
    store = ShardStore(tmp_path)
    groups = _groups(120)
    _commit(store, groups, range(12))
    cfg = ServeConfig(store_root=str(tmp_path), follow_interval_s=0.05, follow_runs=["gen"], batch_metadata=True)
    seen: dict = {}
    served = _life(cfg, 4, seen)
    assert seen == {"sources": 12, "blocks": 0, "queued": 120}
    compact_run(ShardStore(tmp_path), "gen", target_bytes=1 << 30)
    if save_manifest:
        checkpoint(ShardStore(tmp_path), "gen")
    served += _life(cfg, 2, seen)
    assert seen == {"sources": 0, "blocks": 1, "queued": 120 - 32}
    state = ServedState(cfg.resolved_state_path())
    assert state.sources() == [] and [(b[0], b[4].tolist()) for b in state.source_blocks()] == [(1, [10] * 12)]
    state.close()
    served += _life(cfg, None, seen)
    assert seen == {"sources": 0, "blocks": 1, "queued": 120 - 48}
    assert len(served) == len(set(served)) == 120


@pytest.mark.parametrize("by_columns", [True, False])
def test_only_runs_of_consecutive_sources_in_file_order_are_folded(tmp_path, monkeypatch, by_columns):
    """Two runs followed together: each scan indexes one's new shards, then the other's, so a run's members have
    ids in two runs (1, 2 and 5, 6); after both runs are compacted each run of ids becomes a block (four), and
    nothing is served twice. The same where the sources cannot be read as columns (looked up one by one)."""
    if not by_columns:
        monkeypatch.setattr(ServedState, "source_columns", lambda self, runs=None: None)
    store = ShardStore(tmp_path)
    groups = _groups(80)

    def commit(chunks: range) -> None:
        for chunk in chunks:
            store.commit("gen", "w0", chunk, groups[chunk * 10:(chunk + 1) * 10])
            store.commit("other", "w0", chunk, groups[40 + chunk * 10:40 + (chunk + 1) * 10])

    cfg = ServeConfig(store_root=str(tmp_path), follow_interval_s=0.05, follow_runs=["gen", "other"], batch_metadata=True)
    seen: dict = {}
    commit(range(2))
    served = _life(cfg, 1, seen)
    commit(range(2, 4))
    served += _life(cfg, 1, seen)
    state = ServedState(cfg.resolved_state_path())
    assert [s[1] for s in state.sources()] == ["gen", "gen", "other", "other"] * 2
    state.close()
    for run in ("gen", "other"):
        compact_run(ShardStore(tmp_path), run, target_bytes=1 << 30)
    served += _life(cfg, 1, seen)
    assert seen["sources"] == 0 and seen["blocks"] == 4
    state = ServedState(cfg.resolved_state_path())
    assert [(b[0], b[1], b[3]) for b in state.source_blocks()] == [(1, "gen", 0), (3, "other", 0), (5, "gen", 20),
                                                                    (7, "other", 20)]
    state.close()
    served += _life(cfg, None, seen)
    assert len(served) == len(set(served)) == 80 and set(served) == {g.group_id for g in groups}


def test_the_scan_leaves_out_blocks_the_caller_knows_and_splits_those_it_knows_in_part(tmp_path):
    store = ShardStore(tmp_path)
    _commit(store, _groups(60), range(6))
    compact_run(store, "gen", target_bytes=1 << 30)
    checkpoint(store, "gen")
    fresh = ShardStore(tmp_path)
    (found,) = scan_new_shards(fresh, ["gen"], set(), set())
    assert isinstance(found, NewBlock) and found.rows == 60 and found.member_rows.tolist() == [10] * 6
    assert found.file_index.num_rows == 60
    file = found.file
    assert scan_new_shards(ShardStore(tmp_path), ["gen"], set(), set(), known_blocks={("gen", file): [(0, 60)]}) == []
    moved: list = []
    parts = scan_new_shards(ShardStore(tmp_path), ["gen"], {("gen", "w0-00000001.parquet")}, set(), moved,
                            known_blocks={("gen", file): [(30, 60)]})
    assert all(isinstance(p, NewShard) for p in parts)
    assert [(p.shard, p.row_offset) for p in parts] == [("w0-00000000.parquet", 0), ("w0-00000002.parquet", 20)]
    assert [(m.shard, m.row_offset) for m in moved] == [("w0-00000001.parquet", 10)]


def test_block_sources_take_a_run_of_ids_and_are_indexed_once(tmp_path):
    state = ServedState(tmp_path / "state.db")
    entries = [("gen", "a.parquet", 5, ()), ("gen", "merged.parquet", BlockRows(0, np.array([3, 4, 5])), ()),
               ("gen", "b.parquet", 2, ())]
    assert state.add_sources(entries) == [1, 2, 5]
    assert state.add_sources(entries) == [1, 2, 5]  # idempotent
    assert state.add_source("gen", "c.parquet", 1) == 6
    assert state.add_sources([("gen", "merged.parquet", BlockRows(12, np.array([7])), ()),
                              ("gen", "merged.parquet", BlockRows(0, np.array([3, 4, 5])), ())]) == [7, 2]
    (first, run_id, file, first_row, rows), _ = state.source_blocks()
    assert (first, run_id, file, first_row, rows.tolist()) == (2, "gen", "merged.parquet", 0, [3, 4, 5])
    assert [s[0] for s in state.sources()] == [1, 5, 6]
    state.close()
