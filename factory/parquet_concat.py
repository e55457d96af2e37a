"""Concatenate Parquet files of one schema without decoding a page: their row groups are copied byte for byte.

A Parquet file is "PAR1", the column chunks' pages (plus any page indexes and
Bloom filters), the footer (a Thrift compact-protocol `FileMetaData`), the
footer's length (4 bytes, little-endian) and "PAR1" again. Merging files of one
schema therefore needs no decoding: each file's data region (the bytes between
the leading "PAR1" and its footer) is copied to the output, every absolute file
offset in its row groups' metadata is moved by where that region landed, and
one footer listing every row group is written at the end. Pages, their CRCs,
dictionaries, statistics and column indexes are carried over unchanged.

Offsets moved (field ids from parquet-format's parquet.thrift):
- ColumnChunk: file_offset (2; 0 means "no metadata outside the footer" and
  stays 0), offset_index_offset (4), column_index_offset (6);
  (a row group of no rows is left out: pyarrow writes one, without data pages, for an empty table);
- ColumnMetaData: data_page_offset (9), index_page_offset (10),
  dictionary_page_offset (11), bloom_filter_offset (14);
- RowGroup: file_offset (5); ordinal (7) is renumbered;
- an OffsetIndex's PageLocation.offset: the index is rewritten and placed right
  after the file's data region (its old copy stays there, unreferenced).

The Thrift reader/writer is generic: every field it is not asked to change is
kept (as its encoded bytes), so nothing a newer writer adds is lost, except in
the four structs that hold offsets, where an unknown field might be an offset:
there it refuses. `ConcatRefused` is raised (and nothing should be kept of the
output) when the files differ in schema, key-value metadata, column orders,
version or writer (`created_by`: readers apply per-writer workarounds), or when
anything unexpected is found: an encrypted file, column data in another file,
offsets outside the data region, more row groups than an ordinal can number.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

MAGIC = b"PAR1"
ENCRYPTED_MAGIC = b"PARE"

# Thrift compact protocol type codes.
_TRUE, _FALSE, _I8, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)


class ConcatRefused(ValueError):
    """The files cannot be concatenated without decoding; the message says why (use a decoding merge instead)."""


class ThriftError(ConcatRefused):
    """Bytes that are not valid Thrift compact protocol."""


# ---------------------------------------------------------------------------------------------------------------
# Thrift compact protocol: a generic reader and writer.
#
# A struct is read as a list of fields [field id, type code, value]; a value is an int (i8/i16/i32/i64, zigzag
# decoded), bool (a bool field), bytes (binary, double: its 8 raw bytes), a list (list/set: (element type,
# [elements]); map: (key type, value type, [(key, value), ...])), a nested struct (list of fields), or `Raw`:
# the encoded bytes of a value that is only carried over.


@dataclass(frozen=True)
class Raw:
    """An encoded value kept as it was read (written back byte for byte)."""

    data: bytes


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        try:
            byte = buf[pos]
        except IndexError:
            raise ThriftError("truncated varint") from None
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 70:
            raise ThriftError("varint longer than 10 bytes")


def _zigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


def _put_varint(out: bytearray, value: int) -> None:
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _put_zigzag(out: bytearray, value: int, bits: int = 64) -> None:
    _put_varint(out, ((value << 1) ^ (value >> (bits - 1))) & ((1 << bits) - 1))


def _skip(buf: bytes, pos: int, ctype: int, in_container: bool = False) -> int:
    """Position after a value of type `ctype` starting at `pos` (nothing is decoded)."""
    if ctype in (_TRUE, _FALSE):
        return pos + 1 if in_container else pos
    if ctype == _I8:
        return pos + 1
    if ctype in (_I16, _I32, _I64):
        while buf[pos] & 0x80:
            pos += 1
        return pos + 1
    if ctype == _DOUBLE:
        return pos + 8
    if ctype == _BINARY:
        length, pos = _varint(buf, pos)
        return pos + length
    if ctype in (_LIST, _SET):
        header = buf[pos]
        pos += 1
        size, element = header >> 4, header & 0x0F
        if size == 15:
            size, pos = _varint(buf, pos)
        if element in (_TRUE, _FALSE, _I8):
            return pos + size
        if element == _DOUBLE:
            return pos + 8 * size
        for _ in range(size):
            pos = _skip(buf, pos, element, True)
        return pos
    if ctype == _MAP:
        size, pos = _varint(buf, pos)
        if size == 0:
            return pos
        types = buf[pos]
        pos += 1
        for _ in range(size):
            pos = _skip(buf, pos, types >> 4, True)
            pos = _skip(buf, pos, types & 0x0F, True)
        return pos
    if ctype == _STRUCT:
        fid = 0
        while True:
            header = buf[pos]
            pos += 1
            if header == 0:
                return pos
            ftype = header & 0x0F
            if header >> 4 == 0:
                _, pos = _varint(buf, pos)
            pos = _skip(buf, pos, ftype)
    raise ThriftError(f"unknown Thrift compact type {ctype} at byte {pos}")


def read_struct(buf: bytes, pos: int, decode: Callable[[int, int], Any] | None = None) -> tuple[list[list[Any]], int]:
    """The fields of the struct at `pos` and the position after it.

    Each field's value is kept as `Raw` unless `decode(field id, type)` returns a reader
    `(buf, pos, type) -> (value, pos)` for it."""
    fields: list[list[Any]] = []
    fid = 0
    try:
        while True:
            header = buf[pos]
            pos += 1
            if header == 0:
                return fields, pos
            ftype = header & 0x0F
            if header >> 4:
                fid += header >> 4
            else:
                raw, pos = _varint(buf, pos)
                fid = (raw >> 1) ^ -(raw & 1)
            if ftype == _TRUE or ftype == _FALSE:
                fields.append([fid, _TRUE, ftype == _TRUE])
                continue
            reader = decode(fid, ftype) if decode else None
            if reader is not None:
                value, pos = reader(buf, pos, ftype)
            else:
                end = _skip(buf, pos, ftype)
                value, pos = Raw(bytes(buf[pos:end])), end
            fields.append([fid, ftype, value])
    except IndexError:
        raise ThriftError("truncated struct") from None


def read_int(buf: bytes, pos: int, ctype: int) -> tuple[int, int]:
    if ctype == _I8:
        return struct.unpack_from("b", buf, pos)[0], pos + 1
    if ctype not in (_I16, _I32, _I64):
        raise ConcatRefused(f"expected an integer field, found Thrift type {ctype}")
    raw, pos = _varint(buf, pos)
    return _zigzag(raw), pos


def read_list(element_reader: Callable[[bytes, int, int], tuple[Any, int]]):
    """A reader of a list whose elements are read by `element_reader`."""

    def reader(buf: bytes, pos: int, ctype: int) -> tuple[tuple[int, list[Any]], int]:
        if ctype not in (_LIST, _SET):
            raise ConcatRefused(f"expected a list field, found Thrift type {ctype}")
        header = buf[pos]
        pos += 1
        size, element = header >> 4, header & 0x0F
        if size == 15:
            size, pos = _varint(buf, pos)
        values = []
        for _ in range(size):
            value, pos = element_reader(buf, pos, element)
            values.append(value)
        return (element, values), pos

    return reader


def write_value(out: bytearray, ctype: int, value: Any) -> None:
    if isinstance(value, Raw):
        out += value.data
    elif ctype == _I8:
        out += struct.pack("b", value)
    elif ctype == _I16:
        _put_zigzag(out, value, 16)
    elif ctype == _I32:
        _put_zigzag(out, value, 32)
    elif ctype == _I64:
        _put_zigzag(out, value, 64)
    elif ctype in (_BINARY, _DOUBLE):
        if ctype == _BINARY:
            _put_varint(out, len(value))
        out += value
    elif ctype in (_LIST, _SET):
        element, values = value
        if len(values) < 15:
            out.append(len(values) << 4 | element)
        else:
            out.append(0xF0 | element)
            _put_varint(out, len(values))
        for item in values:
            write_value(out, element, item)
    elif ctype == _STRUCT:
        write_struct(out, value)
    else:  # maps and container booleans are only ever carried as Raw
        raise ThriftError(f"cannot write a decoded value of Thrift type {ctype}")


def write_struct(out: bytearray, fields: list[list[Any]]) -> None:
    last = 0
    for fid, ctype, value in fields:
        wire = (_TRUE if value else _FALSE) if ctype in (_TRUE, _FALSE) else ctype
        delta = fid - last
        if 0 < delta <= 15:
            out.append(delta << 4 | wire)
        else:
            out.append(wire)
            _put_zigzag(out, fid, 16)
        last = fid
        if type(value) is Raw:
            out += value.data
        elif ctype == _I64:
            _put_varint(out, ((value << 1) ^ (value >> 63)) & 0xFFFFFFFFFFFFFFFF)
        elif ctype not in (_TRUE, _FALSE):
            write_value(out, ctype, value)
    out.append(0)


def _get(fields: list[list[Any]], fid: int) -> list[Any] | None:
    for field in fields:
        if field[0] == fid:
            return field
    return None


# ---------------------------------------------------------------------------------------------------------------
# Parquet footers.

_FILE_FIELDS = set(range(1, 10))
_ROW_GROUP_FIELDS = set(range(1, 8))
_COLUMN_CHUNK_FIELDS = set(range(1, 10))
_COLUMN_META_FIELDS = set(range(1, 18))
_COMPARED = {1: "format version", 2: "schema", 5: "key-value metadata", 6: "writer (created_by)", 7: "column orders"}


def _known(fields: list[list[Any]], known: set[int], what: str) -> None:
    for fid, _, _ in fields:
        if fid not in known:
            raise ConcatRefused(f"{what} has field {fid}, unknown to this reader (it may hold a file offset)")


def _known_or_walked(raw: Raw) -> Callable[[bytes, int, int], tuple[Raw, int]]:
    """A reader that takes `raw` as it is where the bytes at the position are it (Thrift values are
    self-delimiting, so a prefix equal to a whole encoded value is that value), else walks the value."""

    def reader(buf: bytes, pos: int, ctype: int) -> tuple[Raw, int]:
        if buf.startswith(raw.data, pos):
            return raw, pos + len(raw.data)
        end = _skip(buf, pos, ctype)
        return Raw(bytes(buf[pos:end])), end

    return reader


_META_INTS = (5, 6, 7, 9, 10, 11, 14, 15)
_META_REPEATED = (1, 2, 3, 4, 8, 13)
"""ColumnMetaData fields usually equal from one file to the next (type, encodings, path, codec, key-value
metadata, encoding stats): remembered per column so that the next file's are recognised, not walked."""


class _RowGroupReader:
    """Reads RowGroup structs, remembering per column the fields that repeat across files (a shortcut only)."""

    def __init__(self) -> None:
        self.columns: list[dict[int, Callable[[bytes, int, int], tuple[Raw, int]]]] = []

    def row_group(self, buf: bytes, pos: int, ctype: int) -> tuple[list[list[Any]], int]:
        if ctype != _STRUCT:
            raise ConcatRefused("a row group is not a struct")
        fields, pos = read_struct(
            buf, pos, lambda fid, t: self.column_list if fid == 1 else read_int if fid in (2, 3, 5, 6, 7) else None)
        _known(fields, _ROW_GROUP_FIELDS, "RowGroup")
        return fields, pos

    def column_list(self, buf: bytes, pos: int, ctype: int) -> tuple[tuple[int, list[Any]], int]:
        if ctype != _LIST:
            raise ConcatRefused("RowGroup.columns is not a list")
        header = buf[pos]
        pos += 1
        size, element = header >> 4, header & 0x0F
        if size == 15:
            size, pos = _varint(buf, pos)
        if element != _STRUCT:
            raise ConcatRefused("a RowGroup column is not a struct")
        while len(self.columns) < size:
            self.columns.append({})
        chunks = []
        for index in range(size):
            memo = self.columns[index]

            def meta(buf: bytes, pos: int, ctype: int, memo: dict = memo) -> tuple[list[list[Any]], int]:
                if ctype != _STRUCT:
                    raise ConcatRefused("ColumnChunk.meta_data is not a struct")
                fields, pos = read_struct(buf, pos, lambda fid, t: read_int if fid in _META_INTS else memo.get(fid))
                _known(fields, _COLUMN_META_FIELDS, "ColumnMetaData")
                for fid, _, value in fields:
                    if fid in _META_REPEATED:
                        memo[fid] = _known_or_walked(value)
                return fields, pos

            chunk, pos = read_struct(buf, pos, lambda fid, t: meta if fid == 3 else read_int if fid in (2, 4, 5, 6, 7) else None)
            _known(chunk, _COLUMN_CHUNK_FIELDS, "ColumnChunk")
            chunks.append(chunk)
        return (element, chunks), pos


def _offset_index(data: bytes, start: int, length: int, shift: int) -> bytes:
    """An OffsetIndex (at `start` in `data`) re-encoded with every page offset moved by `shift`."""

    def location(buf: bytes, pos: int, ctype: int):
        if ctype != _STRUCT:
            raise ConcatRefused("a PageLocation is not a struct")
        return read_struct(buf, pos, lambda fid, t: read_int if fid == 1 else None)

    fields, end = read_struct(data, start, lambda fid, t: read_list(location) if fid == 1 else None)
    if end != start + length:
        raise ConcatRefused(f"offset index is {end - start} bytes, its column chunk says {length}")
    locations = _get(fields, 1)
    if locations is None:
        raise ConcatRefused("offset index without page locations")
    for page in locations[2][1]:
        offset = _get(page, 1)
        if offset is None:
            raise ConcatRefused("page location without an offset")
        offset[2] += shift
    out = bytearray()
    write_struct(out, fields)
    return bytes(out)


@dataclass
class Footer:
    fields: list[list[Any]]
    """FileMetaData fields; field 4 (row_groups) decoded, the others Raw."""
    data_end: int
    """Where the data region ends (the footer starts)."""

    def raw(self, fid: int) -> bytes | None:
        field = _get(self.fields, fid)
        return None if field is None else field[2].data

    @property
    def row_groups(self) -> list[list[list[Any]]]:
        field = _get(self.fields, 4)
        if field is None:
            raise ConcatRefused("footer without row groups")
        return field[2][1]

    @property
    def num_rows(self) -> int:
        field = _get(self.fields, 3)
        if field is None:
            raise ConcatRefused("footer without num_rows")
        return read_int(field[2].data, 0, _I64)[0]


def read_footer(data: bytes | memoryview, name: str = "file", same: dict[int, Raw] | None = None,
                reader: _RowGroupReader | None = None) -> Footer:
    """The parsed footer of the Parquet file whose bytes are `data`.

    `same`: encoded FileMetaData fields (by id) expected to be found as they are (a shortcut, not a check)."""
    size = len(data)
    if size < 12 or data[:4] != MAGIC:
        raise ConcatRefused(f"{name} does not start with {MAGIC!r}")
    tail = bytes(data[-4:])
    if tail == ENCRYPTED_MAGIC:
        raise ConcatRefused(f"{name} has an encrypted footer")
    if tail != MAGIC:
        raise ConcatRefused(f"{name} does not end with {MAGIC!r}")
    length = int.from_bytes(data[-8:-4], "little")
    start = size - 8 - length
    if start < 4:
        raise ConcatRefused(f"{name}: footer length {length} does not fit in {size} bytes")
    buf = bytes(data[start : size - 8])
    groups = read_list((reader or _RowGroupReader()).row_group)
    if same is None:
        fields, end = read_struct(buf, 0, lambda fid, t: groups if fid == 4 else None)
    else:  # fields equal to the first file's (schema, key-value metadata) are recognised, not walked
        def known(buf: bytes, pos: int, ctype: int, raw: Raw) -> tuple[Raw, int]:
            if buf.startswith(raw.data, pos):
                return raw, pos + len(raw.data)
            end = _skip(buf, pos, ctype)
            return Raw(buf[pos:end]), end

        def decode(fid: int, ctype: int):
            if fid == 4:
                return groups
            raw = same.get(fid)
            return None if raw is None else lambda buf, pos, ctype: known(buf, pos, ctype, raw)

        fields, end = read_struct(buf, 0, decode)
    if end != len(buf):
        raise ConcatRefused(f"{name}: footer is {end} bytes of Thrift, its length says {len(buf)}")
    _known(fields, _FILE_FIELDS, "FileMetaData")
    if _get(fields, 8) is not None or _get(fields, 9) is not None:
        raise ConcatRefused(f"{name} is encrypted (plaintext footer)")
    return Footer(fields, start)


def _check_range(name: str, what: str, offset: int, length: int, data_end: int) -> None:
    if offset < 4 or length < 0 or offset + length > data_end:
        raise ConcatRefused(f"{name}: {what} {offset}..{offset + length} is outside the data region 4..{data_end}")


def _shift_row_group(group: list[list[Any]], shift: int, name: str, data_end: int, data: Any,
                     offset_indexes: bytearray, index_base: int) -> None:
    """Move every file offset of `group` by `shift`; rewritten offset indexes are appended to `offset_indexes`,
    which will be written at `index_base` in the output."""
    for fid, ctype, value in group:
        if fid == 5:  # RowGroup.file_offset
            _check_range(name, "row group start", value, 0, data_end)
    columns = _get(group, 1)
    if columns is None:
        raise ConcatRefused(f"{name}: a row group without columns")
    for chunk in columns[2][1]:
        if _get(chunk, 1) is not None:
            raise ConcatRefused(f"{name}: column data in another file (ColumnChunk.file_path)")
        if _get(chunk, 8) is not None or _get(chunk, 9) is not None:
            raise ConcatRefused(f"{name}: encrypted column")
        meta = _get(chunk, 3)
        if meta is None:
            raise ConcatRefused(f"{name}: a column chunk without ColumnMetaData")
        meta = meta[2]
        compressed = _get(meta, 7)
        page = _get(meta, 9)
        if compressed is None or page is None:
            raise ConcatRefused(f"{name}: a column chunk without its size or first page")
        first = min(f[2] for f in meta if f[0] in (9, 10, 11))
        _check_range(name, "column chunk", first, compressed[2], data_end)
        bloom, bloom_length = _get(meta, 14), _get(meta, 15)
        if bloom is not None:
            _check_range(name, "bloom filter", bloom[2], bloom_length[2] if bloom_length else 0, data_end)
        for field in meta:
            if field[0] in (9, 10, 11, 14):
                field[2] += shift
        for field in chunk:
            if field[0] == 2 and field[2]:  # deprecated ColumnChunk.file_offset; 0 means "not written"
                field[2] += shift
            elif field[0] == 6:
                length = _get(chunk, 7)
                _check_range(name, "column index", field[2], length[2] if length else 0, data_end)
                field[2] += shift
        index, index_length = _get(chunk, 4), _get(chunk, 5)
        if index is not None:
            if index_length is None:
                raise ConcatRefused(f"{name}: offset index without its length")
            _check_range(name, "offset index", index[2], index_length[2], data_end)
            encoded = _offset_index(data, index[2], index_length[2], shift)
            index[2] = index_base + len(offset_indexes)
            index_length[2] = len(encoded)
            offset_indexes += encoded
    for field in group:
        if field[0] == 5:
            field[2] += shift


class ParquetConcat:
    """Writes the concatenation of Parquet files of one schema to `out` (a binary file positioned at 0).

        concat = ParquetConcat(out)
        for data in files:          # each file's whole bytes
            concat.add(data)
        concat.finish()             # the footer; `concat.rows`, `concat.row_groups`

    `add` raises `ConcatRefused` (the output is then unusable) for a file that cannot be appended as it is.
    `write` (default `out.write`) may be replaced, e.g. to hash what is written."""

    def __init__(self, out: BinaryIO, write: Callable[[Any], Any] | None = None) -> None:
        self.write = write or out.write
        self.position = 0
        self.first: Footer | None = None
        self.groups = bytearray()
        """Encoded RowGroup structs, in order."""
        self.row_groups = 0
        self.rows = 0
        self.finished = False
        self._same: dict[int, Raw] | None = None
        self._reader = _RowGroupReader()
        self._emit(MAGIC)

    def _emit(self, data: Any) -> None:
        self.write(data)
        self.position += len(data)

    def add(self, data: bytes | memoryview, name: str = "file") -> int:
        """Append one file's row groups; the rows it holds."""
        if self.finished:
            raise ValueError("add after finish")
        footer = read_footer(data, name, self._same, self._reader)
        if self.first is None:
            self.first = footer
            self._same = {fid: value for fid, _, value in footer.fields if fid in _COMPARED}
        else:
            for fid, what in _COMPARED.items():
                if footer.raw(fid) != self.first.raw(fid):
                    raise ConcatRefused(f"{name}: {what} differs from the first file's")
        groups = footer.row_groups
        rows = footer.num_rows
        if any(_get(group, 3) is None for group in groups):
            raise ConcatRefused(f"{name}: a row group without num_rows")
        if sum(_get(group, 3)[2] for group in groups) != rows:
            raise ConcatRefused(f"{name}: row groups do not add up to the footer's num_rows {rows}")
        if self.row_groups + len(groups) > 32767:
            raise ConcatRefused("more than 32767 row groups: RowGroup.ordinal (i16) cannot number them")
        shift = self.position - 4
        data_length = footer.data_end - 4
        indexes = bytearray()
        for group in groups:
            if not _get(group, 3)[2]:
                continue  # a row group of no rows (an empty file's): nothing to read, and its pages start nowhere
            _shift_row_group(group, shift, name, footer.data_end, data, indexes, self.position + data_length)
            ordinal = _get(group, 7)
            if ordinal is not None:
                ordinal[2] = self.row_groups
            self.row_groups += 1
            write_struct(self.groups, group)
        self._emit(memoryview(data)[4 : footer.data_end])
        if indexes:
            self._emit(indexes)
        self.rows += rows
        return rows

    def finish(self) -> int:
        """Write the footer; the output's size in bytes."""
        if self.first is None:
            raise ConcatRefused("nothing to concatenate")
        fields: list[list[Any]] = []
        for fid, ctype, value in self.first.fields:
            if fid == 3:
                value = self.rows
            elif fid == 4:
                header = bytearray()
                if self.row_groups < 15:
                    header.append(self.row_groups << 4 | _STRUCT)
                else:
                    header.append(0xF0 | _STRUCT)
                    _put_varint(header, self.row_groups)
                value = Raw(bytes(header) + bytes(self.groups))
            fields.append([fid, ctype, value])
        footer = bytearray()
        write_struct(footer, fields)
        self._emit(footer)
        self._emit(len(footer).to_bytes(4, "little") + MAGIC)
        self.finished = True
        return self.position


def concat_files(paths: list[Any], out_path: Any) -> int:
    """Concatenate the Parquet files `paths` into `out_path`; the rows written (a convenience for tools and tests)."""
    with open(out_path, "wb") as out:
        concat = ParquetConcat(out)
        for path in paths:
            with open(path, "rb") as handle:
                concat.add(handle.read(), str(path))
        concat.finish()
    return concat.rows
