"""The fast synthetic store builder (factory/synthetic_store.py) makes real shards: byte for byte what
`ShardStore.commit` writes for the same groups, logged as it logs them, distinct, and a store that `verify` passes."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from environments.groups import make_group_id
from factory.store import ShardStore
from factory.synthetic import synthetic_groups
from factory.synthetic_store import COMMITTED_AT, ShardFactory, build_store, commit_line, group_id, item_key


def _groups(factory: ShardFactory, chunk: int):
    """The ScoredGroups shard `chunk` holds, as a datagen worker would commit them."""
    return [group.model_copy(update={"group_id": gid, "item_key": key})
            for group, (gid, key) in zip(synthetic_groups(factory.groups_per_shard, group_size=4, seq_len=64, env="bench"),
                                         factory.groups(chunk))]


def test_group_id_matches_make_group_id():
    for index in (0, 7, 10**9 + 3):
        assert group_id("bench", item_key(index)) == make_group_id("bench", item_key(index), 0, 0)


def test_patched_shards_are_what_commit_writes(tmp_path):
    factory = ShardFactory(groups_per_shard=10, group_size=4, seq_len=64, env="bench")
    store = ShardStore(tmp_path)
    for chunk in range(40):  # enough chunks that shards take the patched path and several CRC-length templates
        record = store.commit("gen", "w0", chunk, _groups(factory, chunk))
        data = factory.shard(chunk)
        assert data == (store.shards_dir("gen") / record.shard).read_bytes(), chunk
        assert commit_line("gen", "w0", chunk, 10, data, factory.summary) == replace(record, committed_at=COMMITTED_AT).to_line()
        assert record.sha256 == hashlib.sha256(data).hexdigest() and record.bytes == len(data)
    assert factory.slow < 40


@pytest.mark.parametrize("workers", [1, 2])
def test_built_store_verifies_and_reads_back(tmp_path, workers):
    built = build_store(tmp_path, "gen", 25, workers=workers, block=10)
    store = ShardStore(tmp_path)
    assert store.verify("gen") == []
    records = store.committed("gen")
    assert len(records) == 25 and built["bytes"] == sum(r.bytes for r in records.values())
    assert store.manifest_path("gen").exists()
    factory = ShardFactory()
    expected = [pair for chunk in range(25) for pair in factory.groups(chunk)]
    rows = []
    for batch in store.iter_batches("gen", columns=["group_id", "item_key"]):
        rows += list(zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()))
    assert sorted(rows) == sorted(expected) and len(set(rows)) == 250
