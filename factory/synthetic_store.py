"""Synthetic shard stores of any size, fast: for scale benchmarks (bench/shards/scale.py) and tests.

Every shard is a real, distinct shard: its own groups (group ids and item keys of its own), a Parquet file that is
byte for byte what the store's writer makes of those groups (`PARQUET_OPTIONS`, page checksums, one row group),
and a commit-log line exactly as `ShardStore.commit` appends it. What is skipped is the per-shard fsync (the
commit log is written in large appends and fsynced once) and the cost of encoding: the groups of all shards
share one payload (tokens, masks, logprobs, messages of `synthetic_group`), and only their `group_id` and
`item_key` differ, so a shard is made by patching a template file rather than by encoding it.

How a template is patched: both columns are plain-encoded, uncompressed strings of a fixed width (keys
`item-<number>` zero-padded to `KEY_DIGITS`, ids of 32 hex characters), so a shard's file has the template's
layout except for

- the two columns' page bodies (the values, at the same offsets),
- the pages' CRC-32 (a Thrift varint of 1-5 bytes in the page header), and
- the min/max statistics of the two columns (page headers and footer; same widths).

Only the CRC's length can move anything else, so one template is kept per pair of CRC lengths, each made the
first time it is needed by writing that shard with pyarrow (the slow path, ~2-5 ms) and noting where those
bytes lie. tests/unit/store/test_synthetic_store.py checks the patched files against pyarrow's own output.
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from factory.commit_log import encode_line
from factory.index_runs import summarize_table
from factory.parquet_concat import _put_zigzag
from factory.parquet_pages import _field_spans
from factory.schema import GROUP_SCHEMA, groups_to_record_batch
from factory.store import PARQUET_OPTIONS, ShardStore, save_manifest, shard_name
from factory.synthetic import synthetic_groups

KEY_DIGITS = 10
"""Item keys are `item-<index of the group in the store>`, zero-padded to this many digits (up to 10**10 groups)."""
PATCHED = ("group_id", "item_key")
COMMITTED_AT = "2026-11-25T00:00:00+00:00"


def item_key(index: int) -> str:
    return f"item-{index:0{KEY_DIGITS}d}"


def group_id(env: str, key: str) -> str:
    """`environments.groups.make_group_id(env, key, 0, 0)` for plain ASCII names (no JSON escapes), without json."""
    return hashlib.sha256(f'["{env}", "{key}", "0", 0]'.encode()).hexdigest()[:32]


def _plain(values: list[bytes]) -> bytes:
    """PLAIN encoding of byte-array values: each one's 4-byte little-endian length, then its bytes."""
    return b"".join(len(v).to_bytes(4, "little") + v for v in values)


def _crc_bytes(body: bytes) -> bytes:
    """The page header's crc field value (a signed i32, zigzag varint) for a page body."""
    crc = zlib.crc32(body)
    out = bytearray()
    _put_zigzag(out, crc - (1 << 32) if crc >= 1 << 31 else crc, 32)
    return bytes(out)


@dataclass
class _Column:
    body: int  # offset of the page body (right after the page header)
    body_size: int
    values: int  # offset of the plain values inside the file (within the body)
    crc: int  # offset of the crc varint in the page header
    stats: list[tuple[int, int]]  # (offset, 0 for min / 1 for max) of each statistics value, page header and footer


class _Template:
    """One shard's file and where its patchable bytes lie."""

    def __init__(self, data: bytes, columns: dict[str, _Column]) -> None:
        self.data = data
        self.columns = columns


class ShardFactory:
    """Makes the bytes of synthetic shards: `shard(chunk)` -> (Parquet bytes, rows).

    Shard `chunk` holds groups `chunk * groups_per_shard ...` of env `env`, each with the same payload of
    `group_size` sequences of `seq_len` tokens; `groups(chunk)` gives the (group_id, item_key) it holds."""

    def __init__(self, groups_per_shard: int = 10, group_size: int = 4, seq_len: int = 64, env: str = "bench") -> None:
        self.groups_per_shard = groups_per_shard
        self.env = env
        batch = groups_to_record_batch(list(synthetic_groups(groups_per_shard, group_size=group_size, seq_len=seq_len, env=env)))
        self._payload = pa.Table.from_batches([batch]).cast(GROUP_SCHEMA)
        self.summary = summarize_table(self._payload)
        """The index summary of every shard's rows (their env, env_id, version and size are the payload's)."""
        self._templates: dict[tuple[int, ...], _Template] = {}
        self.slow = 0
        """Shards written by pyarrow because no template had their CRC lengths yet."""

    def groups(self, chunk: int) -> list[tuple[str, str]]:
        start = chunk * self.groups_per_shard
        keys = [item_key(i) for i in range(start, start + self.groups_per_shard)]
        return [(group_id(self.env, k), k) for k in keys]

    def table(self, chunk: int) -> pa.Table:
        """The shard's rows as the store's writer would get them (the slow path; and the tests' reference)."""
        ids, keys = zip(*self.groups(chunk))
        table = self._payload
        for name, values in (("group_id", ids), ("item_key", keys)):
            table = table.set_column(table.schema.get_field_index(name), GROUP_SCHEMA.field(name), pa.array(values, pa.string()))
        return table

    def encode(self, chunk: int) -> bytes:
        """The shard's file as pyarrow writes it with the store's options (`ShardStore.commit`'s writer)."""
        sink = io.BytesIO()
        with pq.ParquetWriter(sink, GROUP_SCHEMA, write_page_checksum=True, **PARQUET_OPTIONS) as writer:
            writer.write_table(self.table(chunk), row_group_size=256)
        return sink.getvalue()

    def shard(self, chunk: int) -> bytes:
        groups = self.groups(chunk)
        values = {name: [g[i].encode() for g in groups] for i, name in enumerate(PATCHED)}
        plain = {name: _plain(v) for name, v in values.items()}
        any_template = next(iter(self._templates.values()), None)
        if any_template is None:
            return self._learn(chunk, values, plain)
        bodies, crcs = {}, {}
        for name in PATCHED:
            column = any_template.columns[name]
            start = column.values - column.body
            body = any_template.data[column.body:column.body + column.body_size]
            bodies[name] = body[:start] + plain[name] + body[start + len(plain[name]):]
            crcs[name] = _crc_bytes(bodies[name])
        template = self._templates.get(tuple(len(crcs[name]) for name in PATCHED))
        if template is None:
            return self._learn(chunk, values, plain)
        data = bytearray(template.data)
        for name in PATCHED:
            column = template.columns[name]
            data[column.values:column.values + len(plain[name])] = plain[name]
            data[column.crc:column.crc + len(crcs[name])] = crcs[name]
            low_high = (min(values[name]), max(values[name]))
            for offset, which in column.stats:
                data[offset:offset + len(low_high[which])] = low_high[which]
        return bytes(data)

    def _learn(self, chunk: int, values: dict[str, list[bytes]], plain: dict[str, bytes]) -> bytes:
        """Write shard `chunk` with pyarrow and keep it as the template of its CRC lengths."""
        self.slow += 1
        data = self.encode(chunk)
        meta = pq.read_metadata(pa.BufferReader(data))
        footer_start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
        columns, lengths = {}, []
        for name in PATCHED:
            chunk_meta = meta.row_group(0).column(meta.schema.to_arrow_schema().get_field_index(name))
            header_at = chunk_meta.data_page_offset
            spans = {fid: (start, end) for fid, start, end in _field_spans(data[header_at:])}
            header_end = header_at + _header_length(data[header_at:])
            crc_start, crc_end = spans[4]
            body_size = chunk_meta.total_compressed_size - (header_end - header_at)
            values_at = data.index(plain[name], header_end, header_end + body_size)
            low, high = min(values[name]), max(values[name])
            stats = []
            for which, value in ((0, low), (1, high)):
                for region in ((header_at, header_end), (footer_start, len(data))):
                    at = data.find(value, *region)
                    while at >= 0:
                        stats.append((at, which))
                        at = data.find(value, at + len(value), region[1])
            columns[name] = _Column(header_end, body_size, values_at, header_at + crc_start + 1, stats)
            lengths.append(crc_end - crc_start - 1)
        self._templates[tuple(lengths)] = _Template(data, columns)
        return data


def _header_length(buf: bytes) -> int:
    """Length of the Thrift struct (a page header) at the start of `buf`."""
    spans = _field_spans(buf)
    return spans[-1][2] + 1  # the stop byte


def commit_line(run_id: str, producer: str, chunk: int, rows: int, data: bytes, index: dict | None = None) -> bytes:
    """The commit-log line `ShardStore.commit` appends for this shard (`CommitRecord(...).to_line()`; `index`: the
    rows' summary, factory/index_runs.py)."""
    record = {"shard": shard_name(producer, chunk), "run_id": run_id, "producer": producer, "chunk": chunk,
              "rows": rows, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "committed_at": COMMITTED_AT}
    if index is not None:
        record["index"] = index
    return encode_line(record)


def write_shards(shards_dir: str, run_id: str, producer: str, chunks: range, options: dict) -> tuple[bytes, int]:
    """Write the shards of `chunks` under `shards_dir`; returns their commit-log lines (in chunk order) and bytes."""
    factory = ShardFactory(**options)
    lines, total = [], 0
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    for chunk in chunks:
        data = factory.shard(chunk)
        fd = os.open(os.path.join(shards_dir, shard_name(producer, chunk)), flags, 0o666)
        try:
            if os.write(fd, data) != len(data):
                raise OSError(f"short write of shard {chunk}")
        finally:
            os.close(fd)
        lines.append(commit_line(run_id, producer, chunk, factory.groups_per_shard, data, factory.summary))
        total += len(data)
    return b"".join(lines), total


def _write_block(args: tuple) -> tuple[bytes, int]:
    return write_shards(*args)


def build_store(root: str | Path, run_id: str, shards: int, *, producer: str = "w0", workers: int = 1,
                block: int = 5000, checkpoint: bool = True, **options) -> dict:
    """A run of `shards` committed synthetic shards (see `ShardFactory` for `options`); returns seconds and bytes.

    `workers` > 1 writes blocks of `block` shards in that many processes; the log is appended in chunk order
    either way, one write per block, and fsynced once. `checkpoint` then reads the log once through the store
    and saves its manifest, as a live store's readers do every so often (the first read of a log without one
    would otherwise be part of whatever is measured first)."""
    begin = time.perf_counter()
    store = ShardStore(root)
    shards_dir = store.shards_dir(run_id)
    shards_dir.mkdir(parents=True, exist_ok=True)
    tasks = [(str(shards_dir), run_id, producer, range(start, min(start + block, shards)), options)
             for start in range(0, shards, block)]
    total = 0
    with open(store.commit_log(run_id), "ab") as log:
        if workers > 1:
            with multiprocessing.get_context("spawn").Pool(workers) as pool:
                for lines, size in pool.imap(_write_block, tasks):
                    log.write(lines)
                    total += size
        else:
            for task in tasks:
                lines, size = _write_block(task)
                log.write(lines)
                total += size
        log.flush()
        os.fsync(log.fileno())
    written = time.perf_counter() - begin
    if checkpoint:  # a reader saves the manifest once 1,000 lines are new; below that, save it here
        reader = ShardStore(root)
        save_manifest(reader.manifest_path(run_id), reader._read_log(run_id))
    return {"seconds": time.perf_counter() - begin, "write_seconds": written, "bytes": total, "shards": shards}
