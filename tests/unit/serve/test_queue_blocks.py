"""Groups queued as blocks (a start-up's scan, a compacted file) behave as groups queued one by one, and are served
exactly once across restarts and compaction."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from factory.serve import queue as queue_module
from factory.serve import service as service_module
from factory.serve.config import ServeConfig
from factory.serve.packer import QUEUED
from factory.serve.queue import Block, GroupQueue
from factory.serve.service import BatchService
from factory.serve.state import TakenRows
from factory.store import ShardStore
from factory.store_compact import compact_run
from factory.synthetic import synthetic_groups
from tests.unit.serve.test_service import REGISTRATION as SERVICE_REGISTRATION
from tests.unit.serve.test_service import batch_ids


def _key(entry) -> tuple:
    return entry.seq, entry.source, entry.row, entry.size, entry.lane, entry.version


@pytest.mark.parametrize("seed", range(6))
def test_blocks_yield_what_one_entry_per_group_yields(monkeypatch, seed):
    """Random prefix/reserve/release/remove on a queue filled by `add` and one filled by `add_many` (blocks opened
    3 groups at a time, from either end): the same entries, in the same order, and the same counts."""
    monkeypatch.setattr(queue_module, "CHUNK", 3)
    rng = random.Random(seed)
    one, many = GroupQueue(), GroupQueue()
    lanes = [q.lane(key) for q in (one, many) for key in (("id", 0), ("name", "b"), ("name", "c"))][:3]
    arrivals = 0
    for _ in range(4):  # blocks, with single entries (posts) between them
        count = rng.randint(1, 40)
        sources = np.array([rng.randint(0, 5) for _ in range(count)], dtype=np.int64)
        rows = np.arange(arrivals, arrivals + count, dtype=np.int64)
        sizes = np.array([rng.choice([1, 2, 4]) for _ in range(count)], dtype=np.int64)
        lane_of = np.array([rng.choice(lanes) for _ in range(count)], dtype=np.int64)
        versions = np.array([rng.randint(0, 9) for _ in range(count)], dtype=np.int64)
        for i in range(count):
            one.add(int(sources[i]), int(rows[i]), int(sizes[i]), int(lane_of[i]), int(versions[i]))
        many.add_many(sources, rows, sizes, lane_of, versions)
        assert _key(one.last) == _key(many.last)
        arrivals += count
        one.add(9, arrivals, 2, lanes[0], 1)
        many.add(9, arrivals, 2, lanes[0], 1)
        arrivals += 1
    assert any(type(item) is Block for lane in many._lanes.values() for item in lane)
    reserved: list[tuple] = []
    for _ in range(60):
        lane, wanted, newest = rng.choice(lanes), rng.randint(1, 30), rng.random() < 0.3
        got_one = list(one.prefix(lane, wanted, newest))
        got_many = list(many.prefix(lane, wanted, newest))
        assert [_key(e) for e in got_one] == [_key(e) for e in got_many]
        pick = [i for i in range(len(got_one)) if rng.random() < 0.5]
        action = rng.choice(["remove", "reserve", "release"])
        if action == "release" and reserved:
            for q, entries in zip((one, many), reserved.pop()):
                q.release(entries)
        elif action == "reserve":
            chosen = ([got_one[i] for i in pick], [got_many[i] for i in pick])
            one.reserve(chosen[0])
            many.reserve(chosen[1])
            reserved.append(chosen)
        else:
            one.remove([got_one[i] for i in pick])
            many.remove([got_many[i] for i in pick])
        assert one.groups == many.groups
        assert +one.lane_sequences == +many.lane_sequences and +one.lane_groups == +many.lane_groups
        assert one.max_group_size() == many.max_group_size() and sorted(one.lanes()) == sorted(many.lanes())
    dropped_one, dropped_many = one.clear(), many.clear()
    assert sorted(map(_key, dropped_one)) == sorted(map(_key, dropped_many))
    assert many.groups == 0 and not any(many.lane_groups.values())
    assert all(type(item) is not Block and item.state != QUEUED for lane in many._lanes.values() for item in lane)


REGISTRATION = {**SERVICE_REGISTRATION, "num_steps": 1000}


@pytest.mark.parametrize("gap", [1 << 16, 3])
@pytest.mark.parametrize("order", ["oldest_first", "newest_first"])
def test_groups_in_blocks_are_served_once_across_restarts_and_compaction(tmp_path, monkeypatch, order, gap):
    """Shards of two envs (one by id, one by name: two lanes in every file) queued as blocks opened 5 groups at a
    time; batches served before a restart, before a compaction, from the merged file after it and after a
    second restart (taken rows left out of the merged file's blocks; with `gap` 3 in several masked stretches
    with untouched ones between them): every group once, none lost."""
    monkeypatch.setattr(queue_module, "CHUNK", 5)
    monkeypatch.setattr(service_module, "SPAN_GAP", gap)
    store = ShardStore(tmp_path)
    groups = list(synthetic_groups(120, group_size=2, seq_len=8))
    for number, group in enumerate(groups):
        group.env, group.env_id = ("a", 0) if number % 3 else ("b", None)
    for chunk in range(12):
        store.commit("gen", "w0", chunk, groups[chunk * 10:(chunk + 1) * 10])
    cfg = ServeConfig(store_root=str(tmp_path), follow_interval_s=0.05, follow_runs=["gen"], batch_metadata=True,
                      batch_order=order)

    async def life(batches: int | None) -> list[str]:
        service = BatchService(cfg)
        await service.start()
        if service.registration is None:
            await service.register(REGISTRATION)
        served: list[str] = []
        while batches is None or batches > 0:
            got = batch_ids((await service.next_batch(False)).raw)
            if not got:
                break
            served += got
            batches = None if batches is None else batches - 1
        await service.stop()  # a prefetched batch is not served: its groups must come back
        return served

    async def scenario() -> list[str]:
        served = await life(3)
        served += await life(2)
        compact_run(ShardStore(tmp_path), "gen", target_bytes=1 << 30)
        assert len(list((tmp_path / "gen" / "shards").glob("*.parquet"))) == 1
        served += await life(4)
        served += await life(None)
        return served

    served = asyncio.run(scenario())
    assert len(served) == len(set(served)) == 120
    assert set(served) == {g.group_id for g in groups}


def test_a_fresh_start_over_a_compacted_file_queues_blocks_not_entries(tmp_path):
    """The point of blocks: a start-up over a compacted file makes no Entry per group until a batch is formed."""
    store = ShardStore(tmp_path)
    for chunk in range(30):
        store.commit("gen", "w0", chunk, synthetic_groups(40, start=chunk * 40, group_size=2, seq_len=8))
    compact_run(store, "gen", target_bytes=1 << 30)

    async def scenario() -> tuple[int, int, int]:
        service = BatchService(ServeConfig(store_root=str(tmp_path), follow_interval_s=3600, follow_runs=["gen"]))
        await service.start()
        items = [item for lane in service.queue._lanes.values() for item in lane]
        result = service.queue.groups, len(items), sum(len(item) for item in items if type(item) is Block)
        await service.stop()
        return result

    groups, items, in_blocks = asyncio.run(scenario())
    assert groups == in_blocks == 1200
    assert items == 1


def _queued(queue: GroupQueue) -> list[tuple]:
    """Every queued group of every lane, front to back (the blocks opened)."""
    return [_key(e) for lane in sorted(queue._lanes) for e in queue.prefix(lane, 1 << 30)]


@pytest.mark.parametrize("seed", range(16))
def test_taken_rows_are_left_out_stretch_by_stretch_as_by_one_mask(tmp_path, monkeypatch, seed):
    """A start-up's queueing with taken rows (a restart): whatever stretches `_spans` cuts the groups into, the
    same groups are queued, in the same order, with the same arrival numbers and counts, as one mask over all of
    them leaves; rows taken beyond a source's end or of sources not queued change nothing. The groups come from
    1-3 files, some with env as codes (a summary's), put in one table or (concat refused) queued file by file."""
    import pyarrow as pa

    rng = random.Random(seed)
    monkeypatch.setattr(service_module, "SPAN_GAP", rng.choice([0, 1, 5, 1 << 16]))
    counts = [rng.randint(0, 12) for _ in range(rng.randint(1, 30))]
    first = rng.randint(1, 50)
    ids = list(range(first, first + len(counts))) if rng.random() < 0.7 else rng.sample(range(1, 200), len(counts))
    total = sum(counts)
    index = pa.table({"env": pa.array([rng.choice("ab") for _ in range(total)], pa.string()),
                      "env_id": pa.array([rng.choice([None, 0, 1]) for _ in range(total)], pa.int64()),
                      "policy_version": pa.array([rng.randint(0, 3) for _ in range(total)], pa.int64()),
                      "group_size": pa.array([rng.choice([1, 2, 4]) for _ in range(total)], pa.int32())})
    taken = {source: {rng.randint(0, 14) for _ in range(rng.randint(1, 4))}
             for source in rng.sample(ids, rng.randint(0, len(ids))) + [999]}
    service = BatchService(ServeConfig(store_root=str(tmp_path / "store"), state_path=str(tmp_path / "s.db")))
    cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randint(0, 2))))
    if rng.random() < 0.5:
        def refuse(*args, **kwargs):
            raise pa.ArrowInvalid("index columns that cannot be put in one table")

        monkeypatch.setattr(pa, "concat_tables", refuse)
    bounds = [0, *cuts, len(ids)]
    first_row = np.concatenate(([0], np.cumsum(counts))).tolist()
    ranges = []
    for lo, hi in zip(bounds, bounds[1:]):
        part = index.slice(first_row[lo], first_row[hi] - first_row[lo])
        table = pa.Table.from_batches(part.to_batches(), schema=index.schema)  # a file's own table object
        if rng.random() < 0.5:  # a file with an index summary: env as codes (index_runs.table_of)
            table = table.cast(pa.schema([pa.field("env", pa.dictionary(pa.int32(), pa.string())),
                                          *list(index.schema)[1:]]))
        ranges += [(table, first_row[n] - first_row[lo], counts[n], ids[n]) for n in range(lo, hi)]
    service._enqueue_ranges(ranges, TakenRows.of(taken))
    expected = GroupQueue()
    for lane_key in service.queue.lane_key_of:
        expected.lane(lane_key)
    position = 0
    for source, count in zip(ids, counts):
        for row in range(count):
            if row not in taken.get(source, ()):
                env_id = index.column("env_id")[position].as_py()
                key = ("id", env_id) if env_id is not None else ("name", index.column("env")[position].as_py())
                expected.add(source, row, index.column("group_size")[position].as_py(), expected.lane(key),
                             index.column("policy_version")[position].as_py())
            position += 1
    assert service.queue.groups == expected.groups
    assert service.queue.lane_groups == expected.lane_groups and service.queue.lane_sequences == expected.lane_sequences
    assert service.queue._sizes == expected._sizes
    assert (service.queue.last is None) == (expected.last is None)
    if expected.last is not None:
        assert _key(service.queue.last) == _key(expected.last)
    assert _queued(service.queue) == _queued(expected)
    service.state.close()


def test_spans_cut_around_taken_positions():
    from factory.serve.service import _spans

    def cut(drop, total, gap):
        service_module.SPAN_GAP, saved = gap, service_module.SPAN_GAP
        try:
            return [(lo, hi, None if out is None else out.tolist()) for lo, hi, out in _spans(np.array(drop), total)]
        finally:
            service_module.SPAN_GAP = saved

    assert cut([0], 1, 4) == [(0, 1, [0])]
    assert cut([3, 5, 20, 21, 40], 50, 4) == [(0, 3, None), (3, 6, [3, 5]), (6, 20, None), (20, 22, [20, 21]),
                                              (22, 40, None), (40, 41, [40]), (41, 50, None)]
    assert cut([3, 5, 20, 21, 40], 41, 1 << 16) == [(0, 3, None), (3, 41, [3, 5, 20, 21, 40])]


def test_int64s_reads_sliced_columns_with_nulls():
    import pyarrow as pa

    from factory.serve.service import _int64s

    column = pa.chunked_array([pa.array([1, None, 3], pa.int64()), pa.array([None, 5, 6, 7], pa.int64())])
    assert _int64s(column, null=-1).tolist() == [1, -1, 3, -1, 5, 6, 7]
    assert _int64s(column.slice(2, 4), null=-9).tolist() == [3, -9, 5, 6]
    assert _int64s(pa.array([None, 2], pa.int32()).slice(1), null=-1).tolist() == [2]
    assert _int64s(pa.array([], pa.int64())).tolist() == []


def test_int32s_read_32_bit_columns_without_a_copy():
    import pyarrow as pa

    from factory.serve.service import _ints

    column = pa.array([4, 8, 16], pa.int32())
    values = _ints(column)
    assert values.dtype == np.int32 and values.tolist() == [4, 8, 16]
    assert values.ctypes.data == column.buffers()[1].address  # the column's own buffer
    sliced = pa.chunked_array([pa.array([1, None], pa.int32()), pa.array([3], pa.int32())]).slice(1)
    got = _ints(sliced, null=-1)
    assert got.dtype == np.int32 and got.tolist() == [-1, 3]


def test_a_start_up_over_shards_does_not_import_pandas(tmp_path):
    """pyarrow's to_numpy/pa.scalar import pandas (~0.4 s); queueing a scan must not need them."""
    import subprocess
    import sys
    import textwrap

    store = ShardStore(tmp_path)
    for chunk in range(6):
        store.commit("gen", "w0", chunk, synthetic_groups(5, start=chunk * 5, group_size=2, seq_len=8))
    compact_run(store, "gen", target_bytes=1 << 30)
    store.commit("gen", "w0", 6, synthetic_groups(5, start=30, group_size=2, seq_len=8))
    script = textwrap.dedent("""
        import asyncio, sys
        from factory.serve.config import ServeConfig
        from factory.serve.service import BatchService

        async def main():
            service = BatchService(ServeConfig(store_root=sys.argv[1], follow_interval_s=3600, follow_runs=["gen"]))
            await service.start()
            print(service.queue.groups, "pandas" in sys.modules)
            await service.stop()

        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["35", "False"]


def test_ingest_run_shards_found_in_a_merged_file_note_exactly_their_own_group_ids(tmp_path):
    """Shards of run-api's own run that a fresh served state finds (compacted) note each member's group ids, read
    once from the merged file: a client retrying those posts stores nothing again."""
    store = ShardStore(tmp_path)
    groups = list(synthetic_groups(24, group_size=2, seq_len=8))
    for chunk in range(6):
        store.commit("api", "w0", chunk, groups[chunk * 4:(chunk + 1) * 4])
    compact_run(store, "api", target_bytes=1 << 30)

    async def scenario() -> tuple[int, set[str]]:
        service = BatchService(ServeConfig(store_root=str(tmp_path), follow_interval_s=3600))
        await service.start()
        stored = await service.ingest([g.model_copy() for g in groups[5:9]])
        known = service.state.known_group_ids([g.group_id for g in groups])
        await service.stop()
        return stored, known

    stored, known = asyncio.run(scenario())
    assert stored == 0 and known == {g.group_id for g in groups}


def test_bulk_load_pauses_collection_and_restores_it_on_error(monkeypatch):
    import gc

    from factory.serve import service as service_module

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with pytest.raises(RuntimeError), service_module._bulk_load({1: "a"}):
            assert not gc.isenabled()
            raise RuntimeError("a failed start-up")
        assert gc.isenabled() and gc.get_freeze_count() == frozen  # a small start-up freezes nothing
        monkeypatch.setattr(service_module, "FREEZE_MIN_SOURCES", 1)
        with service_module._bulk_load({1: "a"}):
            pass
        assert gc.isenabled() and gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()
        gc.enable()


def test_taken_rows_come_back_as_arrays_in_key_order_with_counts_per_source(tmp_path):
    from factory.serve.state import ServedState

    state = ServedState(tmp_path / "s.db")
    assert len(state.taken_rows()) == 0 and state.taken_rows().count(3) == 0
    state.record_taken([(7, 2), (3, 9), (7, 0), (3, 1)], 0)
    state.record_taken([(12, 4)], 1)
    taken = state.taken_rows()
    assert taken.sources.tolist() == [3, 3, 7, 7, 12] and taken.rows.tolist() == [1, 9, 0, 2, 4]
    assert [taken.count(source) for source in (3, 7, 12, 5)] == [2, 2, 1, 0]
    again = TakenRows.of({12: {4}, 3: {9, 1}, 7: {2, 0}})
    assert again.sources.tolist() == taken.sources.tolist() and again.rows.tolist() == taken.rows.tolist()
    state.close()
