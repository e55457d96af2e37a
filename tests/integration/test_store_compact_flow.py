"""The `compact` flow on a real local Prefect server: beside a live writer, every group once, a missing run in one line."""

from __future__ import annotations

import threading

import pytest

from factory.store import ShardStore, StoreError
from factory.synthetic import synthetic_groups

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("workers", [1, 2])
def test_compact_flow_merges_beside_a_live_writer(prefect_server, tmp_path, monkeypatch, workers):
    import multiprocessing

    import factory.store_compact as store_compact
    from flows.compact import compact

    if workers > 1:  # several batches of these small shards, merged by worker processes forked from the flow's
        real = store_compact.plan
        monkeypatch.setattr(store_compact, "plan", lambda records, _target, **kw: real(records, 20_000, **kw))
        monkeypatch.setattr(store_compact, "PARALLEL_MIN_BYTES", 0)

    others = set(multiprocessing.active_children())  # children of other tests (the shared scorer pool's workers)
    store = ShardStore(tmp_path)
    for chunk in range(20):
        store.commit("run-1", "w0", chunk, synthetic_groups(5, start=chunk * 5, group_size=2, seq_len=8))
    stop = threading.Event()

    def write() -> None:  # a live datagen worker committing while the flow compacts
        writer, chunk = ShardStore(tmp_path), 0
        while not stop.is_set() and chunk < 200:
            writer.commit("run-1", "w1", chunk, synthetic_groups(5, start=10_000 + chunk * 5, group_size=2, seq_len=8))
            chunk += 1

    thread = threading.Thread(target=write)
    thread.start()
    try:
        reports = compact(store_root=str(tmp_path), runs=["run-1"], target_mb=1, flush=True, workers=workers)
    finally:
        stop.set()
        thread.join()
    assert reports[0]["shards"] >= 20 and reports[0]["files"]
    assert len(reports[0]["files"]) > 1 or workers == 1
    assert set(multiprocessing.active_children()) - others == set()  # the compaction's workers stopped with it
    fresh = ShardStore(tmp_path)
    ids = [g.group_id for g in fresh.iter_groups("run-1")]
    assert len(ids) == len(set(ids)) == fresh.count("run-1") and fresh.verify("run-1") == []
    with pytest.raises(StoreError, match="no commit log"):
        compact(store_root=str(tmp_path), runs=["nope"])
