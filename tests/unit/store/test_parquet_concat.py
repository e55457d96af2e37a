"""Parquet files concatenated without decoding: the same rows for pyarrow and polars, page checksums, statistics
and page indexes intact; anything that cannot be copied as it is refused."""

from __future__ import annotations

import io
import random
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from factory.parquet_concat import ConcatRefused, ParquetConcat, concat_files, read_footer, read_int, read_list, read_struct
from factory.schema import GROUP_SCHEMA, groups_to_record_batch
from factory.store import PARQUET_OPTIONS
from factory.synthetic import synthetic_groups

SCHEMA = pa.schema([
    pa.field("id", pa.int64(), nullable=False),
    pa.field("name", pa.string()),
    pa.field("flag", pa.bool_()),
    pa.field("score", pa.float64()),
    pa.field("at", pa.timestamp("us", tz="UTC")),
    pa.field("tokens", pa.list_(pa.list_(pa.int32()))),
    pa.field("scores", pa.list_(pa.float64())),
    pa.field("text", pa.large_string()),
    pa.field("nested", pa.list_(pa.list_(pa.list_(pa.float64())))),
], metadata={b"kind": b"test"})


def random_table(rng: random.Random, rows: int, first_id: int) -> pa.Table:
    def maybe(value):
        return None if rng.random() < 0.2 else value

    def ints():
        return [[rng.randrange(-5, 50_000) for _ in range(rng.randrange(0, 6))] for _ in range(rng.randrange(0, 4))]

    return pa.table({
        "id": list(range(first_id, first_id + rows)),
        "name": [maybe(f"name-{rng.randrange(20)}") for _ in range(rows)],
        "flag": [maybe(rng.random() < 0.5) for _ in range(rows)],
        "score": [maybe(rng.uniform(-1, 1)) for _ in range(rows)],
        "at": [maybe(1_700_000_000_000_000 + rng.randrange(10**9)) for _ in range(rows)],
        "tokens": [maybe(ints()) for _ in range(rows)],
        "scores": [maybe([maybe(rng.random()) for _ in range(rng.randrange(0, 5))]) for _ in range(rows)],
        "text": [maybe("x" * rng.randrange(0, 300)) for _ in range(rows)],
        "nested": [maybe([[[rng.random()] * rng.randrange(3)] * rng.randrange(3)] * rng.randrange(3)) for _ in range(rows)],
    }, schema=SCHEMA)


def write(path: Path, table: pa.Table, **options) -> Path:
    pq.write_table(table, path, write_page_checksum=True, **options)
    return path


def checked_read(path: Path) -> pa.Table:
    return pq.ParquetFile(path, page_checksum_verification=True).read()


def shards(tmp_path: Path, count: int = 4, **options) -> tuple[list[Path], list[pa.Table]]:
    rng = random.Random(7)
    paths, tables = [], []
    first = 0
    for number in range(count):
        table = random_table(rng, rng.randrange(1, 60), first)
        first += table.num_rows
        paths.append(write(tmp_path / f"in-{number}.parquet", table, row_group_size=rng.randrange(3, 40), **options))
        tables.append(table)
    return paths, tables


def test_concatenation_is_the_inputs_rows_for_pyarrow_and_polars(tmp_path):
    paths, tables = shards(tmp_path, compression="zstd")
    out = tmp_path / "out" / "merged.parquet"
    out.parent.mkdir()
    assert concat_files(paths, out) == sum(t.num_rows for t in tables)
    expected = pa.concat_tables(tables)
    merged = pq.ParquetFile(out)
    assert merged.metadata.num_row_groups == sum(pq.ParquetFile(p).metadata.num_row_groups for p in paths)
    assert [merged.metadata.row_group(i).to_dict()["ordinal"] if "ordinal" in merged.metadata.row_group(i).to_dict()
            else i for i in range(merged.metadata.num_row_groups)] == list(range(merged.metadata.num_row_groups))
    assert checked_read(out).equals(expected)
    assert merged.schema_arrow.metadata[b"kind"] == b"test"
    frame = pl.read_parquet(out)
    assert frame.equals(pl.from_arrow(expected))
    assert pl.scan_parquet(str(out.parent / "*.parquet")).collect().equals(pl.from_arrow(expected))
    assert pl.scan_parquet(str(tmp_path / "in-*.parquet")).collect().equals(frame)  # as the inputs read together
    # Each row group read alone is the rows it held in its own file.
    offset = 0
    for number in range(merged.metadata.num_row_groups):
        group = merged.read_row_group(number)
        assert group.equals(expected.slice(offset, group.num_rows))
        offset += group.num_rows


def decoded(buf: bytes, pos: int, ctype: int):
    """A Thrift value read whole (structs, lists and integers decoded)."""
    if ctype == 12:
        return read_struct(buf, pos, lambda fid, t: decoded if t in (3, 4, 5, 6, 9, 12) else None)
    if ctype == 9:
        return read_list(decoded)(buf, pos, ctype)
    return read_int(buf, pos, ctype)


def test_statistics_and_page_indexes_are_carried_over(tmp_path):
    paths, tables = shards(tmp_path, write_page_index=True, data_page_size=512)
    out = tmp_path / "merged.parquet"
    concat_files(paths, out)
    merged = pq.ParquetFile(out, page_checksum_verification=True)
    copied = [pq.ParquetFile(p).metadata.row_group(i) for p in paths for i in range(pq.ParquetFile(p).metadata.num_row_groups)]
    for number, original in enumerate(copied):
        group = merged.metadata.row_group(number)
        assert group.num_rows == original.num_rows
        for column in range(group.num_columns):
            before, after = original.column(column), group.column(column)
            assert after.is_stats_set == before.is_stats_set
            if before.is_stats_set:
                assert after.statistics.equals(before.statistics)
            assert after.total_compressed_size == before.total_compressed_size
            assert after.has_offset_index == before.has_offset_index and after.has_column_index == before.has_column_index
    # Each rewritten offset index points at its column chunk's pages where they now are.
    data = out.read_bytes()
    for group in read_footer(data).row_groups:
        for chunk in group[0][2][1]:
            fields = {f[0]: f[2] for f in chunk}
            meta = {f[0]: f[2] for f in fields[3]}
            index, _ = decoded(data[: fields[4] + fields[5]], fields[4], 12)
            pages = [{f[0]: f[2] for f in page} for page in index[0][2][1]]
            assert pages[0][1] == meta[9] and pages[0][3] == 0
            assert all(a[1] + a[2] == b[1] for a, b in zip(pages, pages[1:]))  # back to back, as written
            assert pages[-1][1] + pages[-1][2] == meta.get(11, meta[9]) + meta[7]  # to the chunk's end
    expected = pa.concat_tables(tables)
    assert merged.read().equals(expected)
    # Row group pruning by statistics and page pruning by the (rewritten) offset index still give the right rows.
    wanted = pc.field("id").isin([3, 70, expected.num_rows - 1])
    assert pq.read_table(out, filters=wanted).column("id").to_pylist() == [3, 70, expected.num_rows - 1]
    pruned = pl.scan_parquet(out).filter(pl.col("id") >= expected.num_rows - 5).collect()
    assert pruned.equals(pl.from_arrow(expected.slice(expected.num_rows - 5)))


def test_group_schema_shards_with_nulls_and_nested_lists(tmp_path):
    paths, tables = [], []
    for number, (count, seq_len) in enumerate([(3, 64), (10, 8), (1, 512), (7, 33)]):
        groups = list(synthetic_groups(count, start=number * 100, group_size=4, seq_len=seq_len))
        for group in groups[::2]:  # optional columns null on some rows, present on others
            group.advantages = None
            group.ref_logprobs = None
        table = pa.Table.from_batches([groups_to_record_batch(groups)]).cast(GROUP_SCHEMA)
        paths.append(write(tmp_path / f"s{number}.parquet", table, row_group_size=4, **PARQUET_OPTIONS))
        tables.append(table)
    out = tmp_path / "merged.parquet"
    concat_files(paths, out)
    expected = pa.concat_tables(tables)
    assert checked_read(out).equals(expected)
    assert pl.read_parquet(out).equals(pl.from_arrow(expected))


def test_fuzz_sizes_row_groups_and_writer_options(tmp_path):
    rng = random.Random(11)
    options = [dict(compression="zstd"), dict(compression="snappy", use_dictionary=False),
               dict(compression="none", data_page_version="2.0"), dict(write_page_index=True, data_page_size=256),
               dict(compression="zstd", write_statistics=False)]
    for trial in range(12):
        option = options[trial % len(options)]
        folder = tmp_path / f"t{trial}"
        folder.mkdir()
        paths, tables, first = [], [], 0
        for number in range(rng.randrange(1, 9)):
            table = random_table(rng, rng.choice([0, 1, 2, rng.randrange(3, 300)]), first)
            first += table.num_rows
            paths.append(write(folder / f"in-{number}.parquet", table, row_group_size=rng.randrange(1, 120), **option))
            tables.append(table)
        out = folder / "merged.parquet"
        assert concat_files(paths, out) == first
        expected = pa.concat_tables(tables)
        assert checked_read(out).equals(expected), (trial, option)
        assert pl.read_parquet(out).equals(pl.from_arrow(expected)), (trial, option)
        assert pq.ParquetFile(out).metadata.num_rows == first


def test_a_different_schema_or_metadata_is_refused(tmp_path):
    paths, tables = shards(tmp_path, count=2)
    other = write(tmp_path / "other.parquet", tables[0].append_column("extra", pa.array([1] * tables[0].num_rows)))
    renamed = write(tmp_path / "renamed.parquet", tables[0].rename_columns([*SCHEMA.names[:-1], "other"]))
    nullable = write(tmp_path / "nullable.parquet", tables[0].cast(pa.schema([f.with_nullable(True) for f in SCHEMA])))
    relabelled = write(tmp_path / "meta.parquet", tables[0].replace_schema_metadata({b"kind": b"other"}))
    for odd, why in [(other, "schema"), (renamed, "schema"), (nullable, "schema"), (relabelled, "key-value metadata")]:
        with pytest.raises(ConcatRefused, match=why):
            concat_files([paths[0], odd], tmp_path / "refused.parquet")


def test_unexpected_footers_are_refused(tmp_path):
    paths, _ = shards(tmp_path, count=1)
    data = paths[0].read_bytes()
    with pytest.raises(ConcatRefused, match="encrypted footer"):
        read_footer(data[:-4] + b"PARE")
    with pytest.raises(ConcatRefused, match="does not end"):
        read_footer(data[:-1])
    with pytest.raises(ConcatRefused, match="does not fit"):
        read_footer(data[:-8] + (len(data)).to_bytes(4, "little") + b"PAR1")
    with pytest.raises(ConcatRefused):
        read_footer(data[:-200] + data[-8:])  # the footer cut short
    with pytest.raises(ConcatRefused, match="nothing"):
        ParquetConcat(io.BytesIO()).finish()


def test_unknown_fields_are_kept_and_offsets_moved(tmp_path):
    """A footer field this reader does not know, outside the structs that hold offsets, is written back as it was."""
    from factory.parquet_concat import read_struct, write_struct

    raw = bytes([0x15, 0x04, 0x1C, 0x18, 0x02, 0x68, 0x69, 0x00, 0x05, 0x94, 0x03, 0x2A, 0x00])
    # i32 field 1 = 2; struct field 2 { binary field 1 = "hi" }; i32 field 202 (long form) = 21
    fields, end = read_struct(raw, 0)
    assert end == len(raw) and [f[0] for f in fields] == [1, 2, 202]
    out = bytearray()
    write_struct(out, fields)
    assert bytes(out) == raw
