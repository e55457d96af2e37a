"""Parquet files merged page by page into few row groups: the same rows (nulls, empty and nested lists, V1 and V2
pages, several codecs) for pyarrow and polars, page checksums intact; what cannot be merged so is refused."""

from __future__ import annotations

import io
import random

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factory.parquet_concat import ConcatRefused
from factory.parquet_pages import PageMerge, merge_files
from factory.schema import GROUP_SCHEMA, groups_to_record_batch
from factory.store import PARQUET_OPTIONS
from factory.synthetic import synthetic_groups
from tests.unit.store.test_parquet_concat import random_table


def encoded(table: pa.Table, **options) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, write_page_checksum=True, **{"use_dictionary": False, **options})
    return sink.getvalue()


def merged(blobs: list[bytes], row_group_rows: int) -> tuple[bytes, PageMerge]:
    out = io.BytesIO()
    merge = PageMerge(out.write, row_group_rows)
    for data in blobs:
        merge.add(data)
    merge.finish()
    return out.getvalue(), merge


def checked_read(data: bytes) -> pa.Table:
    return pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True).read()


CASES = [  # (rows per member, writer options, output row group rows)
    ([5, 0, 3, 17, 1, 9], dict(compression="zstd"), 8),
    ([4, 4, 4, 4], dict(compression="snappy", data_page_version="2.0"), 1),
    ([30, 2, 0, 0, 11], dict(compression="none", row_group_size=7), 20),  # members of several row groups
    ([1] * 40, dict(compression="gzip", write_statistics=False), 256),
    ([0, 0], dict(compression="zstd"), 4),  # nothing but empty members
    ([25, 25], dict(compression="zstd", data_page_size=64, data_page_version="2.0"), 10),  # many pages per chunk
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("sizes,options,group_rows", CASES)
def test_merged_file_reads_back_as_the_members_concatenated(seed, sizes, options, group_rows):
    rng = random.Random(seed * 1000 + sum(sizes))
    tables, first = [], 0
    for rows in sizes:
        tables.append(random_table(rng, rows, first))
        first += rows
    data, merge = merged([encoded(t, **options) for t in tables], group_rows)
    expected = pa.concat_tables(tables)
    assert merge.rows == expected.num_rows
    assert checked_read(data).equals(expected)
    assert pl.read_parquet(io.BytesIO(data)).equals(pl.from_arrow(expected))
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    assert meta.num_row_groups == merge.row_groups
    counts = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    assert all(count >= group_rows for count in counts[:-1])  # closed at the first member boundary past the target
    boundaries = {sum(sizes[: i + 1]) for i in range(len(sizes))}
    assert all(sum(counts[: i + 1]) in boundaries for i in range(len(counts)))  # a member never straddles two


def test_store_shards_merge_into_row_groups_of_many_shards():
    batches = [groups_to_record_batch(list(synthetic_groups(10, start=10 * i, group_size=4, seq_len=16))) for i in range(30)]
    tables = [pa.Table.from_batches([b]).cast(GROUP_SCHEMA) for b in batches]
    blobs = [encoded(t, row_group_size=256, **PARQUET_OPTIONS) for t in tables]
    data, merge = merged(blobs, 256)
    assert checked_read(data).equals(pa.concat_tables(tables))
    assert merge.row_groups == 2 and pq.ParquetFile(pa.BufferReader(data)).metadata.row_group(0).num_rows == 260


def test_members_with_dictionary_pages_are_refused():
    rng = random.Random(1)
    plain, dictionary = encoded(random_table(rng, 5, 0)), encoded(random_table(rng, 5, 5), use_dictionary=True)
    with pytest.raises(ConcatRefused, match="dictionary"):
        merged([dictionary, plain], 4)
    with pytest.raises(ConcatRefused, match="dictionary page"):
        merged([plain, dictionary], 4)


@pytest.mark.parametrize("other,why", [
    (dict(compression="snappy"), "codec"),
    (dict(store_schema=False), "key-value metadata"),
])
def test_members_that_differ_are_refused(other, why):
    rng = random.Random(2)
    first, second = encoded(random_table(rng, 5, 0), compression="zstd"), encoded(random_table(rng, 5, 5), **{"compression": "zstd", **other})
    with pytest.raises(ConcatRefused, match=why):
        merged([first, second], 4)


def test_a_member_of_another_schema_is_refused():
    rng = random.Random(3)
    table = random_table(rng, 5, 0)
    with pytest.raises(ConcatRefused, match="schema"):
        merged([encoded(table), encoded(table.drop_columns(["text"]))], 4)


def test_merge_files(tmp_path):
    rng = random.Random(4)
    tables = [random_table(rng, 6, 6 * i) for i in range(3)]
    paths = []
    for i, table in enumerate(tables):
        paths.append(tmp_path / f"{i}.parquet")
        paths[-1].write_bytes(encoded(table))
    assert merge_files(paths, tmp_path / "out.parquet", row_group_rows=10) == 18
    assert pq.read_table(tmp_path / "out.parquet").equals(pa.concat_tables(tables))
    assert pq.read_schema(paths[0]).equals(pq.read_schema(tmp_path / "out.parquet"), check_metadata=True)
