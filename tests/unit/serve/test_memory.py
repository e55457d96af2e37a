"""What keeps run-api's RSS near what it holds: Arrow in the system malloc, batches encoded without reference cycles."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import orjson
import pytest

from factory.serve import memory
from factory.serve.payload import PayloadReader, batch_json, encode_batch, encode_groups
from factory.store import ShardStore
from factory.synthetic import synthetic_groups


def test_arrow_cpp_allocations_go_to_the_system_malloc_once_the_service_set_it_up(tmp_path):
    if memory.LIBC is None:
        pytest.skip("no glibc")
    script = textwrap.dedent(
        """
        import sys
        from factory.serve.memory import limit_malloc_arenas
        assert limit_malloc_arenas()
        import pyarrow as pa, pyarrow.parquet as pq
        pq.write_table(pa.table({"x": list(range(100_000))}), sys.argv[1], compression="zstd")
        print(pa.default_memory_pool().backend_name, pa.mimalloc_memory_pool().max_memory(),
              pa.jemalloc_memory_pool().max_memory() if hasattr(pa, "jemalloc_memory_pool") else 0)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != memory.ARROW_POOL_ENV}
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "x.parquet")], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["system", "0", "0"]  # the Parquet writer allocated nothing from mimalloc/jemalloc


def test_a_batch_body_is_one_orjson_call_with_no_reference_cycles(tmp_path):
    store = ShardStore(tmp_path)
    groups = list(synthetic_groups(12, group_size=3, seq_len=16))
    groups[2].advantages = [[0.5] * 16 for _ in range(3)]
    groups[3].distill_token_ids = [[[1, 2]] * 16 for _ in range(3)]
    groups[3].distill_logprobs = [[[-0.1, -2.0]] * 16 for _ in range(3)]
    store.commit("r", "p", 0, groups, row_group_groups=4)
    path = store.shard_paths("r")[0]
    reader = PayloadReader(1 << 20)
    in_order = reader.read([(path, row) for row in range(2, 9)])  # FIFO: no reordering copy
    shuffled = reader.read([(path, row) for row in (9, 3, 0, 11)])
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        bodies = [encode_batch(table, metadata=metadata) for table in (in_order, shuffled) for metadata in (False, True)]
        # A closure calling itself is a cycle that kept each batch's Arrow buffers until the GC ran.
        assert gc.collect() == 0
    finally:
        if was:
            gc.enable()
    assert bodies[0] == batch_json(encode_groups(in_order))
    assert bodies[3] == batch_json(encode_groups(shuffled, metadata=True))
    assert [g["tokens"] for g in orjson.loads(bodies[2])["batch"]] == [groups[r].tokens for r in (9, 3, 0, 11)]
    assert orjson.loads(bodies[0])["batch"][1]["distill_logprobs"] == groups[3].distill_logprobs


def test_batch_json_joins_once():
    assert batch_json([]) == b'{"batch":[]}'
    assert batch_json([b"{}", b'{"a":1}']) == b'{"batch":[{},{"a":1}]}'


@pytest.mark.parametrize("rows_per_chunk", [1, 4, 100])
def test_a_gzip_batch_made_a_few_rows_at_a_time_is_the_json_body_gzipped(tmp_path, rows_per_chunk):
    import gzip

    from factory.serve.http import gzip_compressor
    from factory.serve.payload import batch_rows, gzip_batch

    store = ShardStore(tmp_path)
    groups = list(synthetic_groups(9, group_size=3, seq_len=16))
    groups[4].distill_token_ids = [[[1, 2]] * 16 for _ in range(3)]
    groups[4].distill_logprobs = [[[-0.1, -2.0]] * 16 for _ in range(3)]
    store.commit("r", "p", 0, groups, row_group_groups=4)
    table = PayloadReader(1 << 20).read([(store.shard_paths("r")[0], row) for row in (8, 0, 4, 5, 1)])
    for metadata in (False, True):
        rows = batch_rows(table, metadata=metadata)
        gz = gzip_batch(rows, gzip_compressor(1), rows_per_chunk=rows_per_chunk)
        assert gz[:2] == b"\x1f\x8b" and rows == []
        assert gzip.decompress(gz) == encode_batch(table, metadata=metadata)
    empty = table.slice(0, 0)
    assert gzip.decompress(gzip_batch(batch_rows(empty), gzip_compressor(6))) == b'{"batch":[]}'


def test_the_reader_keeps_only_the_row_group_the_next_batch_starts_in(tmp_path):
    from factory.serve.payload import PayloadError

    store = ShardStore(tmp_path)
    groups = list(synthetic_groups(12, group_size=2, seq_len=8))
    store.commit("r", "p", 0, groups, row_group_groups=4)  # row groups: rows 0-3, 4-7, 8-11
    path = store.shard_paths("r")[0]
    reader = PayloadReader(1 << 20)
    first = reader.read([(path, row) for row in range(0, 6)])
    assert [list(map(list, t)) for t in first.column("tokens").to_pylist()] == [groups[r].tokens for r in range(6)]
    assert list(reader._cache) == [(path, 1)]  # not row group 0, which no later batch needs
    path.unlink()  # what is cached still serves; what is not must be read again
    assert reader.read([(path, 6), (path, 7)]).column("tokens").to_pylist() == [groups[6].tokens, groups[7].tokens]
    with pytest.raises(PayloadError):
        reader.read([(path, 8)])


@pytest.mark.parametrize("rows_per_chunk", [1, 4, 64])
def test_a_json_batch_made_a_few_rows_at_a_time_is_the_json_body(tmp_path, rows_per_chunk):
    from factory.serve.payload import batch_rows, json_batch

    store = ShardStore(tmp_path)
    store.commit("r", "p", 0, list(synthetic_groups(9, group_size=3, seq_len=16)), row_group_groups=4)
    table = PayloadReader(1 << 20).read([(store.shard_paths("r")[0], row) for row in (8, 0, 4, 5, 1)])
    for metadata in (False, True):
        rows = batch_rows(table, metadata=metadata)
        assert bytes(json_batch(rows, rows_per_chunk=rows_per_chunk)) == encode_batch(table, metadata=metadata)
        assert rows == []
    assert bytes(json_batch(batch_rows(table.slice(0, 0)))) == b'{"batch":[]}'
