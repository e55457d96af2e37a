"""A restarted run removes the half-written shards a killed process of the same producer left in shards/."""

from __future__ import annotations

from pathlib import Path

from factory.run_control import RunOwner
from factory.store import ShardStore
from factory.synthetic import synthetic_groups


def test_claim_removes_this_producers_temp_files_only(tmp_path: Path) -> None:
    store = ShardStore(tmp_path)
    store.commit("run", "prod", 0, synthetic_groups(2, group_size=2, seq_len=4, vocab=20, seed=0))
    shards = store.shards_dir("run")
    ours = shards / ".prod-00000003.parquet.0123456789ab.tmp"      # what a kill during commit leaves (0 bytes)
    other = shards / ".prod-2-00000001.parquet.0123456789ab.tmp"   # another producer, maybe still writing
    ours.write_bytes(b"")
    other.write_bytes(b"")
    owner = RunOwner(store.run_dir("run"), "prod")
    owner.claim([])
    assert not ours.exists() and other.exists()
    assert [p.name for p in store.shard_paths("run")] == ["prod-00000000.parquet"]
    owner.release()


def test_claim_keeps_temp_files_while_an_owner_on_another_host_may_write(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "shards").mkdir(parents=True)
    leftover = run_dir / "shards" / ".prod-00000001.parquet.0123456789ab.tmp"
    leftover.write_bytes(b"")
    owner = RunOwner(run_dir, "prod")
    owner.path.write_text('{"host": "another-node", "pid": 1, "flow_runs": []}')
    owner.claim([])
    assert leftover.exists()
