"""Crash-safe dataset writers: Parquet (default) or JSONL, as one file or a directory of shards.

Nothing becomes visible until it is complete: a new output is written under a
hidden temporary name (file or directory), fsynced and renamed into place on
`close`. An existing output is refused unless `overwrite` (replaced whole on
close) or `append` (a file is rewritten as old + new rows, then renamed; a
directory gets new shards numbered after the existing ones, each renamed into
place). A crash leaves the previous output as it was, plus a hidden temp.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from factory.export.config import OutputConfig
from factory.commit_log import fsync_dir as fsync_path  # a file or a directory (factory.store's fsync_path)

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)

_SHARD = re.compile(r"^part-(\d{5,})\.(parquet|jsonl)$")
_FLUSH_ROWS = 2048


class OutputExistsError(FileExistsError):
    """The output path exists and neither overwrite nor append was asked for."""


class _ShardFile:
    """One output file being written (Parquet or JSONL)."""

    def __init__(self, path: Path, fmt: str, schema: pa.Schema) -> None:
        self.path, self.fmt, self.schema, self.rows = path, fmt, schema, 0
        self.handle = open(path, "wb")
        import pyarrow.parquet as pq  # only Parquet outputs need it (not on the JSON lines CLIs' start-up path)

        self.parquet = pq.ParquetWriter(self.handle, schema, compression="zstd") if fmt == "parquet" else None

    def write(self, rows: list[dict[str, Any]]) -> None:
        if self.parquet is not None:
            import pyarrow as pa  # only Parquet outputs (not imported by the JSON lines CLIs' start-up)

            self.parquet.write_table(pa.Table.from_pylist(rows, schema=self.schema))
        else:
            self.handle.write(b"".join(orjson.dumps(row) + b"\n" for row in rows))
        self.rows += len(rows)

    def copy_from(self, source: Path) -> None:
        """Write an existing output's rows first (append to a single file)."""
        if self.parquet is not None:
            import pyarrow.parquet as pq

            existing = pq.ParquetFile(source)
            if not existing.schema_arrow.remove_metadata().equals(self.schema.remove_metadata()):
                raise ValueError(
                    f"cannot append to {source}: its columns {existing.schema_arrow.names} differ from this export's "
                    f"{self.schema.names}; write to a new path or pass overwrite"
                )
            for batch in existing.iter_batches(batch_size=8192):
                self.parquet.write_batch(batch)
                self.rows += batch.num_rows
        else:
            with open(source, "rb") as old:
                shutil.copyfileobj(old, self.handle, 1 << 20)

    def close(self) -> None:
        if self.parquet is not None:
            self.parquet.close()
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()


class DatasetWriter:
    """Writes rows of one schema to `output.path`; call `close()` to publish, `abort()` to discard."""

    def __init__(self, output: OutputConfig, schema: pa.Schema) -> None:
        self.output, self.schema = output, schema
        self.fmt = output.resolved_format
        self.final = Path(output.path).expanduser().absolute()
        self.rows = 0
        self._pending: list[dict[str, Any]] = []
        self._closed = False
        if self.final.exists() and not (output.overwrite or output.append):
            raise OutputExistsError(
                f"output {self.final} already exists; pass --append-to-previous (output.append) to add to it "
                "or --overwrite (output.overwrite) to replace it"
            )
        if self.final.exists() and output.single_file != self.final.is_file():
            raise OutputExistsError(f"output {self.final} exists as a {'file' if self.final.is_file() else 'directory'}; "
                                    "pick a path of the other kind or remove it")
        self.final.parent.mkdir(parents=True, exist_ok=True)
        nonce = uuid.uuid4().hex[:12]
        self.temp = self.final.parent / f".{self.final.name}.{nonce}.tmp"
        self._files: list[_ShardFile] = []
        self._next_shard = 0
        if output.single_file:
            self._current: _ShardFile | None = _ShardFile(self.temp, self.fmt, schema)
            if output.append and self.final.exists():
                self._current.copy_from(self.final)
            self._files.append(self._current)
        else:
            self.temp.mkdir()
            if output.append and self.final.exists():
                numbers = [int(m.group(1)) for p in self.final.iterdir() if (m := _SHARD.match(p.name))]
                self._next_shard = max(numbers, default=-1) + 1
                self._check_append_schema()
            self._current = None

    def _check_append_schema(self) -> None:
        existing = sorted(self.final.glob(f"part-*.{self.fmt}"))
        if self.fmt == "parquet" and existing:
            import pyarrow.parquet as pq

            names = pq.read_schema(existing[0]).names
            if names != self.schema.names:
                raise ValueError(
                    f"cannot append to {self.final}: its columns {names} differ from this export's {self.schema.names}; "
                    "write to a new path or pass overwrite"
                )

    def write(self, row: dict[str, Any]) -> None:
        self._pending.append(row)
        if len(self._pending) >= _FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        while rows:
            if self._current is None or (not self.output.single_file and self._current.rows >= self.output.rows_per_shard):
                self._open_shard()
            room = len(rows) if self.output.single_file else self.output.rows_per_shard - self._current.rows
            self._current.write(rows[:room])
            self.rows += len(rows[:room])
            rows = rows[room:]

    def _open_shard(self) -> None:
        if self._current is not None:
            self._current.close()
        name = f"part-{self._next_shard:05d}.{self.fmt}"
        self._next_shard += 1
        self._current = _ShardFile(self.temp / name, self.fmt, self.schema)
        self._files.append(self._current)

    def close(self) -> list[Path]:
        """Finish every file and publish the output; returns the paths written."""
        self.flush()
        if not self.output.single_file and not self._files:
            self._open_shard()  # an empty export still publishes one empty, loadable shard
        self._current.close()
        self._closed = True
        if self.output.single_file:
            os.replace(self.temp, self.final)
            fsync_path(self.final.parent)
            return [self.final]
        fsync_path(self.temp)
        if self.output.append and self.final.exists():
            published = []
            for shard in self._files:
                target = self.final / shard.path.name
                os.replace(shard.path, target)
                published.append(target)
            fsync_path(self.final)
            self.temp.rmdir()
            return published
        old = None
        if self.final.exists():
            old = self.final.parent / f".{self.final.name}.{uuid.uuid4().hex[:12]}.old"
            os.replace(self.final, old)
        os.replace(self.temp, self.final)
        fsync_path(self.final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return [self.final / shard.path.name for shard in self._files]

    def abort(self) -> None:
        """Discard everything written; the previous output (if any) stays as it was."""
        if self._closed:
            return
        self._closed = True
        for shard in self._files:
            try:
                shard.close()
            except (OSError, ValueError):
                pass
        if self.temp.is_dir():
            shutil.rmtree(self.temp, ignore_errors=True)
        else:
            self.temp.unlink(missing_ok=True)
