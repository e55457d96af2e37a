"""The shard store on an object store (s3://bucket/prefix, S3-compatible), through pyarrow's filesystems.

Layout under the URL, as on a local root: `<run>/shards/<shard>.parquet` and the run's commit log, here a
prefix `<run>/commits/` holding one small JSON object per commit, named by the shard (`<producer>-<chunk>`).

Atomic commit, per backend:
- Local or shared POSIX path (`ShardStore`): write a temp file, fsync, rename to the final name, fsync the
  directory, then append and fsync the commit-log line; the log line is the commit.
- Object store (`ObjectShardStore`): there is no rename, no append and no fsync, but a PUT is atomic (an
  object is either absent or whole) and durable once it returns. A commit PUTs the shard object under its
  final, unique name first, then PUTs its commit record; the record is the commit. Readers see only shards
  that have a record, so a writer killed between the two PUTs leaves an invisible object, never a torn shard.
  The log is one object per commit, so no read-modify-write of a shared log object is ever needed.

  Concurrency rule (chosen instead of conditional writes, which pyarrow's S3 filesystem cannot issue): one
  writer per (run, producer). Names are unique per (producer, chunk), so writers with distinct producer names
  never touch the same object; a commit first checks for its own record and writes nothing if it exists
  (exactly-once for a retried chunk). Two live writers sharing a producer name are not supported.

Not done on object stores (yet): compaction, the manifest checkpoint, repair and the follower cursor; the
run-api and viewer still take a local root. Readers list the record prefix (cost grows with the run's commits).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from environments.groups import ScoredGroup
from factory.schema import GROUP_SCHEMA, groups_to_record_batch, record_batch_to_groups
from factory.store import PARQUET_OPTIONS, READ_BATCH_GROUPS, CommitRecord, ShardStore, StoreError, _check_name, shard_name

OBJECT_SCHEMES = ("s3",)


def is_store_url(root: Any) -> bool:
    return isinstance(root, str) and urlsplit(root).scheme in OBJECT_SCHEMES


def open_store(root: str | os.PathLike[str]) -> ShardStore | ObjectShardStore:
    """The store at `root`: an object store for an s3:// URL, else a local or shared path."""
    return ObjectShardStore(root) if is_store_url(root) else ShardStore(root)


def _has_credentials() -> bool:
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return True
    # Profiles, web identity (Kubernetes) and container roles; an EC2 instance role is not detected here: set
    # AWS_PROFILE or use `?anonymous=true` only where that is really meant.
    for var in ("AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        if os.environ.get(var):
            return True
    files = [os.environ.get("AWS_SHARED_CREDENTIALS_FILE", os.path.expanduser("~/.aws/credentials"))]
    return any(os.path.isfile(path) for path in files)


class ObjectShardStore:
    """Committed shards and their commit records on an S3-compatible object store (see the module docstring).

    `url`: s3://bucket/prefix. The endpoint of a non-AWS server comes from `AWS_ENDPOINT_URL` (or the URL's
    `?endpoint_override=` query); credentials from the usual AWS variables, profile or credentials file.
    """

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in OBJECT_SCHEMES or not parts.netloc:
            raise StoreError(f"store URL {url!r} is not s3://bucket/prefix; give a bucket (and optional prefix)")
        if "anonymous=true" not in parts.query and not _has_credentials():
            raise StoreError(
                f"no credentials for store {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
            )
        self.url = url
        options: dict[str, Any] = {}
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and "endpoint_override" not in parts.query:
            scheme, _, host = endpoint.partition("://")
            options.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
        if options:
            self.fs = pafs.S3FileSystem(region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"), **options)
            self.base = f"{parts.netloc}{parts.path}".rstrip("/")
        else:
            self.fs, self.base = pafs.FileSystem.from_uri(url)
            self.base = self.base.rstrip("/")
        self.problems: list[Any] = []

    # ---- layout ----
    def _run(self, run_id: str) -> str:
        _check_name("run id", run_id)
        return f"{self.base}/{run_id}"

    def shard_path(self, run_id: str, shard: str) -> str:
        return f"{self._run(run_id)}/shards/{shard}"

    def _record_path(self, run_id: str, shard: str) -> str:
        return f"{self._run(run_id)}/commits/{shard}.json"

    def _fail(self, what: str, error: Exception) -> StoreError:
        return StoreError(f"{what} on store {self.url} failed: {error}")

    def runs(self) -> list[str]:
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.base, allow_not_found=True))
        except OSError as error:
            raise self._fail("listing runs", error) from None
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)

    # ---- write ----
    def commit(self, run_id: str, producer: str, chunk: int, groups: Iterable[ScoredGroup | dict[str, Any]] | pa.Table) -> CommitRecord:
        """Store one chunk exactly once: the shard object under its final name, then its commit record."""
        _check_name("producer", producer)
        name = shard_name(producer, chunk)
        existing = self.record(run_id, name)
        if existing is not None:
            return replace(existing, skipped=True)
        if isinstance(groups, (pa.Table, pa.RecordBatch)):
            table = pa.Table.from_batches([groups]) if isinstance(groups, pa.RecordBatch) else groups
        else:
            table = pa.Table.from_batches([groups_to_record_batch([g if isinstance(g, ScoredGroup) else ScoredGroup.model_validate(g) for g in groups])])
        sink = pa.BufferOutputStream()
        pq.write_table(table.cast(GROUP_SCHEMA), sink, write_page_checksum=True, **PARQUET_OPTIONS)
        data = sink.getvalue()
        try:
            with self.fs.open_output_stream(self.shard_path(run_id, name)) as out:  # one PUT: absent or whole
                out.write(data)
            record = CommitRecord(
                shard=name, run_id=run_id, producer=producer, chunk=chunk, rows=table.num_rows, bytes=data.size,
                sha256=hashlib.sha256(memoryview(data)).hexdigest(), committed_at=datetime.now(timezone.utc).isoformat(),
            )
            with self.fs.open_output_stream(self._record_path(run_id, name)) as out:  # the commit
                out.write(record.to_line())
        except OSError as error:
            raise self._fail(f"commit of {run_id}/{name}", error) from None
        return record

    # ---- read ----
    def record(self, run_id: str, shard: str) -> CommitRecord | None:
        try:
            with self.fs.open_input_stream(self._record_path(run_id, shard)) as handle:
                return _parse(handle.read())
        except FileNotFoundError:
            return None
        except OSError as error:
            if "NoSuchKey" in str(error) or "does not exist" in str(error):
                return None
            raise self._fail(f"reading the record of {run_id}/{shard}", error) from None

    def committed(self, run_id: str) -> dict[str, CommitRecord]:
        """Committed shards of a run, in commit order (time of the record, then name)."""
        selector = pafs.FileSelector(f"{self._run(run_id)}/commits", allow_not_found=True)
        try:
            paths = [i.path for i in self.fs.get_file_info(selector) if i.path.endswith(".json")]
            records = []
            for path in paths:
                with self.fs.open_input_stream(path) as handle:
                    records.append(_parse(handle.read()))
        except OSError as error:
            raise self._fail(f"listing the commits of {run_id}", error) from None
        records.sort(key=lambda r: (r.committed_at, r.shard))
        return {r.shard: r for r in records}

    def count(self, run_id: str) -> int:
        return sum(r.rows for r in self.committed(run_id).values())

    def iter_batches(self, run_id: str, *, columns: list[str] | None = None, batch_size: int = READ_BATCH_GROUPS) -> Iterator[pa.RecordBatch]:
        """A run's committed rows as record batches, shard by shard in commit order (objects without a record are
        never read: they are commits cut short)."""
        for record in self.committed(run_id).values():
            path = self.shard_path(run_id, record.shard)
            try:
                with self.fs.open_input_file(path) as handle:
                    yield from pq.ParquetFile(handle, page_checksum_verification=True).iter_batches(batch_size=batch_size, columns=columns)
            except (OSError, pa.ArrowException) as error:
                raise self._fail(f"reading shard {run_id}/{record.shard}", error) from None

    def iter_groups(self, run_id: str, *, validate: bool = False) -> Iterator[ScoredGroup]:
        for batch in self.iter_batches(run_id):
            yield from record_batch_to_groups(batch, validate=validate)

    def export_jsonl(self, run_id: str, out: Any) -> int:
        """Write a run's groups as JSON lines to a text stream (the simplest export off an object store)."""
        count = 0
        for group in self.iter_groups(run_id):
            out.write(group.model_dump_json() + "\n")
            count += 1
        return count


def _parse(data: bytes) -> CommitRecord:
    from factory.store import parse_commit_line

    return parse_commit_line(data)


__all__ = ["ObjectShardStore", "open_store", "is_store_url"]
