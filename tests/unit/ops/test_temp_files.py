"""A restarted run cleans up what a killed process of the same producer left in its run: half-written shard temp
files and stats of uncommitted chunks go, a shard whose commit record is durable is renamed into place."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

from factory.datagen.ops import RunOps
from factory.run_control import RunOwner
from factory.sampling import chunk_stats_name
from factory.store import ShardStore
from factory.synthetic import synthetic_groups


def groups(chunk: int):
    return synthetic_groups(2, start=2 * chunk, group_size=2, seq_len=4, vocab=20, seed=0)


def start(store: ShardStore) -> RunOps:
    """What DatagenRun does first when it opens run 'run' of producer 'prod'."""
    datagen = SimpleNamespace(run_id="run", producer="prod", shutdown_grace_s=1.0, target_groups=None)
    return RunOps.start(store, SimpleNamespace(datagen=datagen), logging.getLogger("test"))


def stop(ops: RunOps) -> None:
    ops.owner.release()
    ops.close()


def test_a_restart_finishes_a_commit_killed_between_its_record_and_its_rename(tmp_path: Path, monkeypatch) -> None:
    # What `kill -9` leaves when it lands after chunk 1's commit record is durable and before its rename (the
    # window in which tests/integration/test_datagen_target.py's kill lands when it sees the record): a logged
    # shard under its temporary name. Chunk 2 was half-written (its stats file comes first, then the temp file).
    store = ShardStore(tmp_path)
    store.commit("run", "prod", 0, groups(0))
    monkeypatch.setattr(ShardStore, "_publish", lambda self, tmp, final: None)
    store.commit("run", "prod", 1, groups(1))
    monkeypatch.undo()
    shards = store.shards_dir("run")
    (staged,) = shards.glob(".prod-00000001.parquet.*.tmp")
    half = shards / ".prod-00000002.parquet.0123456789ab.tmp"
    half.write_bytes(b"PAR1")
    other = shards / ".prod-2-00000001.parquet.0123456789ab.tmp"  # another producer, maybe still writing
    other.write_bytes(b"")
    store.write_run_file("run", chunk_stats_name("prod", 1), "{}")
    store.write_run_file("run", chunk_stats_name("prod", 2), "{}")

    restarted = ShardStore(tmp_path)
    ops = start(restarted)
    try:
        assert not staged.exists() and not half.exists() and other.exists()
        assert sorted(p.name for p in shards.glob("*.parquet")) == ["prod-00000000.parquet", "prod-00000001.parquet"]
        assert (store.run_dir("run") / chunk_stats_name("prod", 1)).is_file()
        assert not (store.run_dir("run") / chunk_stats_name("prod", 2)).exists()
        assert restarted.verify("run") == []
        assert restarted.count("run") == len(list(restarted.iter_groups("run"))) == 4
    finally:
        stop(ops)


def test_a_restart_leaves_temp_files_alone_while_an_owner_on_another_host_may_write(tmp_path: Path) -> None:
    store = ShardStore(tmp_path)
    run_dir = store.run_dir("run")
    (run_dir / "shards").mkdir(parents=True)
    leftover = run_dir / "shards" / ".prod-00000001.parquet.0123456789ab.tmp"
    leftover.write_bytes(b"")
    stats = store.write_run_file("run", chunk_stats_name("prod", 1), "{}")
    owner = RunOwner(run_dir, "prod")
    owner.path.write_text('{"host": "another-node", "pid": 1, "flow_runs": []}')
    ops = start(store)
    try:
        assert leftover.exists() and stats.exists()
    finally:
        stop(ops)
