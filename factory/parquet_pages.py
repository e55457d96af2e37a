"""Merge small Parquet files of one schema into few row groups without decoding a page.

factory/parquet_concat.py copies whole row groups, so a file merged from
thousands of ~36 kB shards has thousands of row groups and a footer entry for
each (every reader then parses megabytes of footer). Here the members' rows
are gathered into row groups of about `row_group_rows` rows instead: the
column chunk of column `c` in an output row group is the members' column
chunks of `c`, one after another, their pages byte for byte (with their CRCs).
Only the column-chunk metadata is written anew: sizes, value counts and the
offset of the first page; statistics, encoding statistics, size statistics,
page indexes and Bloom filters of the members are dropped (optional in Parquet;
the page headers' own statistics stay with their pages).

This is valid because a column chunk is a sequence of self-contained pages:
a data page (V1 or V2) carries its own repetition and definition levels (so
list columns and nulls concatenate too) and each member chunk ends on a row
boundary. It is not valid for a chunk that starts with a dictionary page (a
chunk has at most one dictionary and its pages index into it): members with a
dictionary page are refused (`ConcatRefused`), and so are members whose schema,
key-value metadata, writer or column orders differ from the first member's,
or whose codec or encodings differ per column (a column chunk has one codec).

The output's encodings list of a column is the first member's (members with a
dictionary page are refused, so no page of another member is dictionary-encoded;
every page header names its own encoding); members of other encodings would
only make that list incomplete, not the pages unreadable.

Per member the work is one footer slice, two byte comparisons (schema at the
start of the footer, key-value metadata / writer / column orders at its end)
and, per output row group, one parse by pyarrow of all its members' row-group
metadata at once (pyarrow's fixed cost per parse is ~2.7 us per schema column,
its cost per column chunk ~0.5 us).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from factory.parquet_concat import (_I16, _I64, _LIST, _STRUCT, MAGIC, ConcatRefused, _put_varint, _put_zigzag, _skip,
                                    _varint, read_footer, write_struct)

DEFAULT_ROW_GROUP_ROWS = 256
_NUM_ROWS_HEADER = 0x10 | _I64  # FileMetaData.num_rows (field 3) right after field 2
_ROW_GROUPS_HEADER = 0x10 | _LIST  # FileMetaData.row_groups (field 4) right after field 3


def _parse_footer(footer: bytes | bytearray) -> pq.FileMetaData:
    """pyarrow's reading of a FileMetaData footer (Thrift bytes), through the public reader: the bytes framed as a
    file with no data pages."""
    framed = b"".join((MAGIC, footer, len(footer).to_bytes(4, "little"), MAGIC))
    return pq.read_metadata(pa.BufferReader(framed))


def _field_spans(buf: bytes) -> list[tuple[int, int, int]]:
    """(field id, start, end) of each field of the struct at the start of `buf` (header included), in order."""
    spans = []
    pos = fid = 0
    while True:
        start = pos
        header = buf[pos]
        pos += 1
        if header == 0:
            return spans
        if header >> 4:
            fid += header >> 4
        else:
            raw, pos = _varint(buf, pos)
            fid = (raw >> 1) ^ -(raw & 1)
        pos = _skip(buf, pos, header & 0x0F)
        spans.append((fid, start, pos))


class _Column:
    """An output column chunk being gathered: the members' byte ranges and the sums of their counts."""

    __slots__ = ("pieces", "values", "uncompressed")

    def __init__(self) -> None:
        self.pieces: list[Any] = []
        self.values = 0
        self.uncompressed = 0


class PageMerge:
    """Writes the rows of Parquet files of one schema (no dictionary pages) to `write`, in order, as row groups of
    at least `row_group_rows` rows each (a member's rows never straddle two row groups; the last may be smaller).

        merge = PageMerge(out.write)
        for data in files:        # each file's whole bytes
            merge.add(data)       # the rows it holds; ConcatRefused where it cannot be merged this way
        merge.finish()            # the footer; `merge.rows`, `merge.row_groups`

    After `ConcatRefused` the output is unusable (merge by decoding instead)."""

    def __init__(self, write: Callable[[Any], Any], row_group_rows: int = DEFAULT_ROW_GROUP_ROWS) -> None:
        self.write = write
        self.row_group_rows = row_group_rows
        self.position = 0
        self.rows = 0
        self.row_groups = 0
        self.finished = False
        self._groups = bytearray()
        """Encoded output RowGroup structs, in order."""
        self._prefix = b""
        """The first member's footer up to field 3 (format version and schema): every member's must start so."""
        self._suffix = b""
        """The first member's footer after field 4 (key-value metadata, writer, column orders, end)."""
        self._head: list[bytes] = []
        """Per column: the encoded ColumnMetaData fields 1-4 (type, encodings, path, codec) of the output."""
        self._codecs: list[str] = []
        self._pending: list[tuple[Any, int, int, int, str]] = []
        """Members not yet written: (data, footer start, row groups, rows, name)."""
        self._pending_groups: list[bytes] = []
        self._pending_rows = 0
        self._pending_count = 0
        self._emit(MAGIC)

    def _emit(self, data: Any) -> None:
        self.write(data)
        self.position += len(data)

    def _first(self, data: Any, name: str) -> None:
        footer = read_footer(data, name)
        buf = bytes(data[footer.data_end : len(data) - 8])
        spans = _field_spans(buf)
        ids = [fid for fid, _, _ in spans]
        if 3 not in ids or 4 not in ids or ids.index(4) != ids.index(3) + 1 or any(fid > 3 for fid in ids[: ids.index(3)]):
            raise ConcatRefused(f"{name}: footer fields in an unexpected order {ids}")
        self._prefix = buf[: spans[ids.index(3)][1]]
        self._suffix = buf[spans[ids.index(4)][2] :]
        groups = footer.row_groups
        if not groups:
            raise ConcatRefused(f"{name}: no row groups")
        for chunk in next(value for fid, _, value in groups[0] if fid == 1)[1]:
            meta = next((value for fid, _, value in chunk if fid == 3), None)
            if meta is None:
                raise ConcatRefused(f"{name}: a column chunk without ColumnMetaData")
            head = [field for field in meta if field[0] in (1, 2, 3, 4)]
            if [field[0] for field in head] != [1, 2, 3, 4]:
                raise ConcatRefused(f"{name}: a column chunk without its type, encodings, path or codec")
            out = bytearray()
            write_struct(out, head)
            self._head.append(bytes(out[:-1]))  # without the end of struct: more fields follow
        metadata = _parse_footer(buf)
        columns = metadata.row_group(0)
        for index in range(metadata.num_columns):
            column = columns.column(index)
            if any("DICTIONARY" in encoding for encoding in column.encodings):
                raise ConcatRefused(f"{name}: column {column.path_in_schema} is dictionary-encoded")
            self._codecs.append(column.compression)

    def add(self, data: bytes | memoryview, name: str = "file") -> int:
        """Append one file's rows (written once `row_group_rows` rows are gathered); the rows it holds."""
        if self.finished:
            raise ValueError("add after finish")
        size = len(data)
        if size < 12 or data[:4] != MAGIC or data[-4:] != MAGIC:
            raise ConcatRefused(f"{name} is not a plain Parquet file (no {MAGIC!r} at both ends)")
        length = int.from_bytes(data[-8:-4], "little")
        start = size - 8 - length
        if start < 4:
            raise ConcatRefused(f"{name}: footer length {length} does not fit in {size} bytes")
        if not self._prefix:
            self._first(data, name)
        footer = bytes(data[start : size - 8])
        if not footer.startswith(self._prefix):
            raise ConcatRefused(f"{name}: format version or schema differs from the first file's")
        if not footer.endswith(self._suffix) or len(footer) < len(self._prefix) + len(self._suffix) + 3:
            raise ConcatRefused(f"{name}: key-value metadata, writer (created_by) or column orders differ from the first file's")
        pos = len(self._prefix)
        if footer[pos] != _NUM_ROWS_HEADER:
            raise ConcatRefused(f"{name}: footer without num_rows where expected")
        raw, pos = _varint(footer, pos + 1)
        rows = (raw >> 1) ^ -(raw & 1)
        if footer[pos] != _ROW_GROUPS_HEADER:
            raise ConcatRefused(f"{name}: footer without row groups where expected")
        header = footer[pos + 1]
        if header & 0x0F != _STRUCT:
            raise ConcatRefused(f"{name}: row groups are not structs")
        groups, pos = header >> 4, pos + 2
        if groups == 15:
            groups, pos = _varint(footer, pos)
        self._pending.append((data, start, groups, rows, name))
        self._pending_groups.append(footer[pos : len(footer) - len(self._suffix)])
        self._pending_count += groups
        self._pending_rows += rows
        if self._pending_rows >= self.row_group_rows:
            self._flush()
        return rows

    def _flush(self) -> None:
        """Write the pending members' rows as one row group."""
        if not self._pending:
            return
        synthetic = bytearray(self._prefix)
        synthetic += bytes((_NUM_ROWS_HEADER, 0, _ROW_GROUPS_HEADER))
        if self._pending_count < 15:
            synthetic.append(self._pending_count << 4 | _STRUCT)
        else:
            synthetic.append(0xF0 | _STRUCT)
            _put_varint(synthetic, self._pending_count)
        synthetic += b"".join(self._pending_groups)
        synthetic.append(0)
        try:  # every member's row groups, parsed in one go
            metadata = _parse_footer(synthetic)
        except (OSError, pa.ArrowException) as error:
            raise ConcatRefused(f"the footers of {self._pending[0][4]} .. {self._pending[-1][4]} cannot be read: {error}") from None
        if metadata.num_row_groups != self._pending_count:
            raise ConcatRefused(f"the footers of {self._pending[0][4]} .. {self._pending[-1][4]} hold "
                                f"{metadata.num_row_groups} row groups, not {self._pending_count}")
        width = len(self._head)
        columns = [_Column() for _ in range(width)]
        codecs = self._codecs
        number = rows = 0
        for data, data_end, groups, member_rows, name in self._pending:
            held = 0
            view = memoryview(data)
            for _ in range(groups):
                group = metadata.row_group(number)
                number += 1
                count = group.num_rows
                if not count:
                    continue  # a row group of no rows (an empty file's): nothing to read
                held += count
                if group.num_columns != width:
                    raise ConcatRefused(f"{name}: a row group of {group.num_columns} columns, the schema has {width}")
                for index in range(width):
                    chunk = group.column(index)
                    if chunk.has_dictionary_page:
                        raise ConcatRefused(f"{name}: column {chunk.path_in_schema} has a dictionary page (a column "
                                            "chunk holds one dictionary: the pages of several cannot follow each other)")
                    if chunk.compression != codecs[index]:
                        raise ConcatRefused(f"{name}: column {chunk.path_in_schema} has another codec than the first file's")
                    if chunk.file_path:
                        raise ConcatRefused(f"{name}: column data in another file (ColumnChunk.file_path)")
                    first = chunk.data_page_offset
                    end = first + chunk.total_compressed_size
                    if first < 4 or end > data_end or end < first:
                        raise ConcatRefused(f"{name}: column chunk {first}..{end} is outside the data region 4..{data_end}")
                    column = columns[index]
                    column.pieces.append(view[first:end])
                    column.values += chunk.num_values
                    column.uncompressed += chunk.total_uncompressed_size
            if held != member_rows:
                raise ConcatRefused(f"{name}: row groups hold {held} rows, the footer says {member_rows}")
            rows += held
        self._pending, self._pending_groups, self._pending_count, self._pending_rows = [], [], 0, 0
        if not rows:
            return
        group_start = self.position
        chunks = bytearray()
        chunks.append(0xF0 | _STRUCT if width >= 15 else width << 4 | _STRUCT)
        if width >= 15:
            _put_varint(chunks, width)
        compressed = uncompressed = 0
        for head, column in zip(self._head, columns):
            offset = self.position
            data = b"".join(column.pieces)
            self._emit(data)
            # ColumnChunk: file_offset (2) = 0 (as pyarrow writes it: no metadata outside the footer), meta_data (3)
            chunks += b"\x26\x00\x1c"
            chunks += head
            for delta, value in ((0x10, column.values), (0x10, column.uncompressed), (0x10, len(data)), (0x20, offset)):
                chunks.append(delta | _I64)  # num_values (5), total_uncompressed (6), total_compressed (7), data_page_offset (9)
                _put_zigzag(chunks, value)
            chunks += b"\x00\x00"  # end of ColumnMetaData, end of ColumnChunk
            compressed += len(data)
            uncompressed += column.uncompressed
        group = bytearray(b"\x19")  # RowGroup.columns (1)
        group += chunks
        for fid_delta, ctype, value in ((1, _I64, uncompressed), (1, _I64, rows), (2, _I64, group_start),
                                        (1, _I64, compressed), (1, _I16, self.row_groups)):
            group.append(fid_delta << 4 | ctype)  # total_byte_size (2), num_rows (3), file_offset (5),
            _put_zigzag(group, value, 16 if ctype == _I16 else 64)  # total_compressed_size (6), ordinal (7)
        group.append(0)
        self._groups += group
        self.row_groups += 1
        self.rows += rows
        if self.row_groups > 32767:
            raise ConcatRefused("more than 32767 row groups: RowGroup.ordinal (i16) cannot number them")

    def finish(self) -> int:
        """Write what is pending and the footer; the output's size in bytes."""
        if not self._prefix:
            raise ConcatRefused("nothing to merge")
        self._flush()
        footer = bytearray(self._prefix)
        footer.append(_NUM_ROWS_HEADER)
        _put_zigzag(footer, self.rows)
        footer.append(_ROW_GROUPS_HEADER)
        if self.row_groups < 15:
            footer.append(self.row_groups << 4 | _STRUCT)
        else:
            footer.append(0xF0 | _STRUCT)
            _put_varint(footer, self.row_groups)
        footer += self._groups
        footer += self._suffix
        self._emit(bytes(footer))
        self._emit(len(footer).to_bytes(4, "little") + MAGIC)
        self.finished = True
        return self.position


def merge_files(paths: list[Any], out_path: Any, row_group_rows: int = DEFAULT_ROW_GROUP_ROWS) -> int:
    """Merge the Parquet files `paths` into `out_path` page by page; the rows written (for tools and tests)."""
    with open(out_path, "wb") as out:
        merge = PageMerge(out.write, row_group_rows)
        for path in paths:
            with open(path, "rb") as handle:
                merge.add(handle.read(), str(path))
        merge.finish()
    return merge.rows

