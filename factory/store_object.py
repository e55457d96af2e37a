"""The shard store on an object store (s3://bucket/prefix, S3-compatible), through pyarrow's filesystems.

Layout under the URL, as on a local root: `<run>/shards/<shard>.parquet`, and for the run's commit log two
prefixes of small JSON objects: `<run>/commits/<shard>.json`, one per commit, named by the shard
(`<producer>-<chunk>`), and `<run>/compactions/<file>.json`, one per merged file (factory/store_object_compact.py).

Atomic commit, per backend:
- Local or shared POSIX path (`ShardStore`): write a temp file, fsync, rename to the final name, fsync the
  directory, then append and fsync the commit-log line; the log line is the commit.
- Object store (`ObjectShardStore`): there is no rename, no append and no fsync, but a PUT is atomic (an
  object is either absent or whole), durable once it returns, and visible to GETs and listings at once (S3 and
  the S3-compatible servers this targets are strongly consistent). A commit PUTs the shard object under its
  final, unique name first, then PUTs its commit record; the record is the commit. Readers see only shards
  that have a record, so a writer killed between the two PUTs leaves an invisible object, never a torn shard.
  The log is one object per commit, so no read-modify-write of a shared log object is ever needed.
- Compaction on an object store: PUT the merged object, then PUT its compaction record (the commit point),
  which lists the members' records and so replaces them; then the members' commit records are deleted, and
  their shard objects later. Readers list `commits/` before `compactions/`: since the compaction record exists
  before any member record is deleted, each shard is found through one of them, and through both it is read
  once, from the merged object. A kill at any step leaves every committed group readable exactly once.

  Concurrency rule (chosen instead of conditional writes, which pyarrow's S3 filesystem cannot issue): one
  writer per (run, producer), one compactor per run. Names are unique per (producer, chunk), so writers with
  distinct producer names never touch the same object; a commit first checks for its own record (or a
  compaction record listing it) and writes nothing if it exists (exactly-once for a retried chunk). Two live
  writers sharing a producer name are not supported, nor is `replace=True`.

What reads an object store: everything written against `StoreReader` (below), which `ShardStore` also provides:
run-api and its follower (shard files are read through `filesystem`; the served state stays a local SQLite
file, `state_path`), the SFT/DPO exports, view-run (shards only: datagen stats and trainer metrics are local run
files) and compaction. Records are immutable, so a store object caches them: a follower poll costs one listing
of `commits/` and one of `compactions/` plus a GET per new record (compaction keeps `commits/` short).
Datagen writes to an object store too (factory/datagen/store.py): its chunks through `commit` (a retried write
task or a resumed run finds the chunk's record and writes nothing, so each chunk is committed once), its own run
files (config, per-chunk stats, curriculum state, summary, owner lock) in a local directory,
`datagen.run_files_dir`. `verify` checks each live object's size and sha256 against its record (streamed) and
looks for group ids stored twice. Not done on object stores: `repair`, the manifest checkpoint.

A missing credential, or a bucket that does not exist, is a one-line `StoreError` (commands print it as their
last line, without a traceback).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace as dataclass_replace
from collections.abc import Callable, Container, Iterable, Iterator
from datetime import datetime, timezone
from typing import Any, Protocol
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from environments.groups import ScoredGroup
from factory.index_runs import summarize_table
from factory.schema import GROUP_SCHEMA, groups_to_record_batch, record_batch_to_groups
from factory.store import (PARQUET_OPTIONS, READ_BATCH_GROUPS, CommitRecord, ShardProblem, ShardStore, StoreError,
                           _batches_in_ranges, _check_name, _take_ranges, shard_name)

OBJECT_SCHEMES = ("s3",)


def is_store_url(root: Any) -> bool:
    return isinstance(root, str) and urlsplit(root).scheme in OBJECT_SCHEMES


class StoreReader(Protocol):
    """What serving (run-api and its follower), export and the viewer use of a store; `ShardStore` (local or shared
    path) and `ObjectShardStore` (s3://) both provide it, so call sites take whichever `open_store` returns.

    Shard locations (`shard_path`, `locate`) are read with pyarrow through `filesystem` (None: a local Path)."""

    root: Any
    problems: list[Any]

    @property
    def filesystem(self) -> pafs.FileSystem | None: ...
    def check(self) -> None: ...
    def runs(self) -> list[str]: ...
    def committed(self, run_id: str) -> dict[str, CommitRecord]: ...
    def record(self, run_id: str, shard: str) -> CommitRecord | None: ...
    def changes(self, run_id: str, cursor: Any = None) -> tuple[Any, list[CommitRecord]]: ...
    def locate(self, run_id: str, shard: str) -> tuple[Any, int, int] | None: ...
    def shard_path(self, run_id: str, name: str) -> Any: ...
    def file_size(self, path: Any) -> int | None: ...
    def finish_commits(self, run_id: str) -> list[str]: ...
    def count(self, run_id: str) -> int: ...
    def iter_batches(self, run_id: str, *, columns: list[str] | None = None, batch_size: int = ...) -> Iterator[pa.RecordBatch]: ...
    def iter_groups(self, run_id: str, *, validate: bool = False) -> Iterator[ScoredGroup]: ...
    def commit(self, run_id: str, producer: str, chunk: int, groups: Any, *, replace: bool = False,
               row_group_groups: int = ..., on_written: Callable[[], None] | None = None) -> CommitRecord: ...


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
        # allow_delayed_open: a small object (a shard, a record) is written by one PUT at close instead of a
        # multipart upload (create, part, complete); each is still absent or whole. An error (a bucket gone) then
        # surfaces at close, inside the same `with` and its `except OSError`.
        if options:
            self.fs = pafs.S3FileSystem(region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
                                        allow_delayed_open=True, **options)
            self.base = f"{parts.netloc}{parts.path}".rstrip("/")
        else:
            delayed = "" if "allow_delayed_open" in parts.query else "allow_delayed_open=true"
            query = "&".join(q for q in (parts.query, delayed) if q)
            self.fs, self.base = pafs.FileSystem.from_uri(parts._replace(query=query).geturl())
            self.base = self.base.rstrip("/")
        self.problems: list[Any] = []
        self.bucket = parts.netloc
        self._checked = False
        self._runs: dict[str, _RunRecords] = {}
        self._lock = threading.Lock()

    @property
    def root(self) -> str:
        """The store URL (what messages name; a local store's `root` is its directory)."""
        return self.url

    @property
    def filesystem(self) -> pafs.FileSystem:
        """The pyarrow filesystem that `shard_path`s are read through (pass as `filesystem=` to pyarrow)."""
        return self.fs

    def __repr__(self) -> str:
        return f"ObjectShardStore({self.url!r})"

    def check(self) -> None:
        """Raise a one-line StoreError when the bucket does not exist or cannot be reached (checked once)."""
        if self._checked:
            return
        try:
            info = self.fs.get_file_info(self.bucket)
        except OSError as error:
            raise self._fail(f"reaching bucket {self.bucket!r}", error) from None
        if info.type == pafs.FileType.NotFound:
            where = f" at {os.environ['AWS_ENDPOINT_URL']}" if os.environ.get("AWS_ENDPOINT_URL") else ""
            raise StoreError(f"bucket {self.bucket!r} of store {self.url} does not exist{where}: create it "
                             f"(e.g. `aws s3 mb s3://{self.bucket}`) or fix the store URL")
        self._checked = True

    def check_writable(self) -> None:
        """The bucket exists and a small object can be written and removed under the store's prefix."""
        self.check()
        probe = f"{self.base}/.preflight-{uuid.uuid4().hex}"
        try:
            with self.fs.open_output_stream(probe) as out:
                out.write(b"ok")
            self.fs.delete_file(probe)
        except OSError as error:
            raise self._fail("writing a probe object", error) from None

    # ---- layout ----
    def _run(self, run_id: str) -> str:
        _check_name("run id", run_id)
        return f"{self.base}/{run_id}"

    def shard_path(self, run_id: str, shard: str) -> str:
        return f"{self._run(run_id)}/shards/{shard}"

    def _record_path(self, run_id: str, shard: str) -> str:
        return f"{self._run(run_id)}/commits/{shard}.json"

    def compaction_path(self, run_id: str, name: str) -> str:
        return f"{self._run(run_id)}/compactions/{name}.json"

    def shards_dir(self, run_id: str) -> str:
        return f"{self._run(run_id)}/shards"

    def _fail(self, what: str, error: Exception) -> StoreError:
        return StoreError(f"{what} on store {self.url} failed: {' '.join(str(error).split())}")

    def runs(self) -> list[str]:
        """Runs (the prefixes under the store URL), sorted by name."""
        self.check()
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.base, allow_not_found=True))
        except OSError as error:
            raise self._fail("listing runs", error) from None
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)

    # ---- write ----
    def commit(
        self,
        run_id: str,
        producer: str,
        chunk: int,
        groups: Iterable[ScoredGroup | dict[str, Any]] | pa.Table | pa.RecordBatch,
        *,
        replace: bool = False,
        row_group_groups: int = 256,
        on_written: Callable[[], None] | None = None,
    ) -> CommitRecord:
        """Store one chunk exactly once: the shard object under its final name, then its commit record.
        `on_written`: called once the shard is encoded, before it is uploaded (see `ShardStore.commit`)."""
        _check_name("producer", producer)
        if replace:
            raise StoreError(f"replacing a committed shard is not supported on object store {self.url}: a reader could "
                             "see the new object with the old record; commit under a new chunk instead")
        self.check()
        name = shard_name(producer, chunk)
        existing = self.record(run_id, name)
        if existing is not None:
            return dataclass_replace(existing, skipped=True)
        if isinstance(groups, (pa.Table, pa.RecordBatch)):
            table = pa.Table.from_batches([groups]) if isinstance(groups, pa.RecordBatch) else groups
        elif callable(to_record_batch := getattr(groups, "to_record_batch", None)):  # a datagen chunk as columns
            table = pa.Table.from_batches([to_record_batch()])
        else:
            table = pa.Table.from_batches([groups_to_record_batch([g if isinstance(g, ScoredGroup) else ScoredGroup.model_validate(g) for g in groups])])
        sink = pa.BufferOutputStream()
        pq.write_table(table.cast(GROUP_SCHEMA), sink, row_group_size=row_group_groups, write_page_checksum=True, **PARQUET_OPTIONS)
        data = sink.getvalue()
        if on_written is not None:
            on_written()
        try:
            with self.fs.open_output_stream(self.shard_path(run_id, name)) as out:  # one PUT: absent or whole
                out.write(data)
            record = CommitRecord(
                shard=name, run_id=run_id, producer=producer, chunk=chunk, rows=table.num_rows, bytes=data.size,
                sha256=hashlib.sha256(memoryview(data)).hexdigest(), committed_at=datetime.now(timezone.utc).isoformat(),
                index=summarize_table(table),
            )
            with self.fs.open_output_stream(self._record_path(run_id, name)) as out:  # the commit
                out.write(record.to_line())
        except OSError as error:
            raise self._fail(f"commit of {run_id}/{name}", error) from None
        return record

    def finish_commits(self, run_id: str) -> list[str]:
        """Nothing to finish: a commit record is written only after its shard object is whole (local stores rename
        shards left under a temporary name here)."""
        return []

    # ---- read ----
    def record(self, run_id: str, shard: str) -> CommitRecord | None:
        cached = self._runs.get(run_id)
        if cached is not None and shard in cached.records:
            return cached.records[shard]
        try:
            found = self._read_json(self._record_path(run_id, shard))
        except OSError as error:
            raise self._fail(f"reading the record of {run_id}/{shard}", error) from None
        if found is not None:
            return _parse(found)
        # Not committed, or committed and then compacted (its own record removed): the compaction records say.
        cached = self._refresh(run_id, commits=False)
        with self._lock:
            return cached.records.get(shard)

    def _read_json(self, path: str) -> bytes | None:
        try:
            with self.fs.open_input_stream(path) as handle:
                return handle.read()
        except FileNotFoundError:
            return None
        except OSError as error:
            if "NoSuchKey" in str(error) or "does not exist" in str(error):
                return None
            raise

    def _list_new(self, prefix: str, seen: Container[str]) -> list[tuple[str, bytes]]:
        """(name, content) of the `.json` objects under `prefix` not in `seen`; one gone since the listing (a commit
        record removed by a compaction) is left out."""
        infos = self.fs.get_file_info(pafs.FileSelector(prefix, allow_not_found=True))
        new = [(i.base_name[:-5], i.path) for i in infos if i.base_name.endswith(".json") and i.base_name[:-5] not in seen]
        with ThreadPoolExecutor(max_workers=min(16, max(1, len(new)))) as pool:
            contents = list(pool.map(self._read_json, [path for _, path in new]))
        return [(name, data) for (name, _), data in zip(new, contents) if data is not None]

    def _refresh(self, run_id: str, *, commits: bool = True) -> _RunRecords:
        """Read the run's commit and compaction records not seen before (both kinds never change once written).

        Commit records are listed before compaction records: a compaction writes its record before it removes its
        members' commit records, so every committed shard is found through one or the other (or both: the
        compaction's placement wins)."""
        self.check()
        with self._lock:
            cached = self._runs.setdefault(run_id, _RunRecords())
            try:
                run = self._run(run_id)
                records = [_parse(data) for _, data in self._list_new(f"{run}/commits", cached.records)] if commits else []
                compactions = [json.loads(data) for _, data in self._list_new(f"{run}/compactions", cached.compactions)]
            except OSError as error:
                raise self._fail(f"listing the commits of {run_id}", error) from None
            for compaction in sorted(compactions, key=lambda c: (c["committed_at"], c["compact"])):
                cached.apply_compaction(compaction)
            for record in sorted(records, key=lambda r: (r.committed_at, r.shard)):
                if record.shard not in cached.records:
                    cached.put(record)
            return cached

    def committed(self, run_id: str) -> dict[str, CommitRecord]:
        """Committed shards of a run, in the order this store object first saw them (by commit time within one
        listing); each call lists the record prefix and reads only records it has not read before."""
        cached = self._refresh(run_id)
        with self._lock:  # the follower's thread and a committer's may refresh it at the same time
            return {name: cached.records[name] for name in cached.order}

    def changes(self, run_id: str, cursor: tuple[int, int] | None = None) -> tuple[tuple[int, int], list[CommitRecord]]:
        """Records committed since `cursor` (None: every record), as `ShardStore.changes`: (next cursor, records).

        Costs one listing of the run's record prefix plus one GET per new record; the cursor is valid for this
        store object (another object's cursor yields every record again, which callers dedupe by shard name)."""
        cached = self._refresh(run_id)
        with self._lock:
            end = len(cached.changed)
            since = cursor[1] if cursor is not None and cursor[0] == id(cached) and cursor[1] <= end else 0
            seen = {name: cached.records[name] for name in cached.changed[since:end]}
        return (id(cached), end), list(seen.values())

    def compactions(self, run_id: str) -> dict[str, str]:
        """The run's compaction records: merged file -> when it was recorded (ISO time, UTC)."""
        cached = self._refresh(run_id, commits=False)
        with self._lock:
            return dict(cached.compactions)

    def locate(self, run_id: str, shard: str) -> tuple[str, int, int] | None:
        record = self.record(run_id, shard)
        return None if record is None else (self.shard_path(run_id, record.physical), record.row_offset, record.rows)

    def file_size(self, path: str) -> int | None:
        """Bytes of the object at `path`, or None when it does not exist."""
        try:
            info = self.fs.get_file_info(path)
        except OSError as error:
            raise self._fail(f"looking up {path}", error) from None
        return None if info.type == pafs.FileType.NotFound else info.size

    def count(self, run_id: str) -> int:
        return sum(r.rows for r in self.committed(run_id).values())

    def iter_batches(self, run_id: str, *, columns: list[str] | None = None, batch_size: int = READ_BATCH_GROUPS) -> Iterator[pa.RecordBatch]:
        """A run's committed rows as record batches, shard by shard in commit order (objects without a record are
        never read: they are commits cut short). An unreadable shard raises (on a local store it is reported in
        `problems` and left out): a read of an object store fails far more often for a passing reason."""
        self.problems = []
        files: dict[str, list[tuple[int, int]] | None] = {}
        for record in self.committed(run_id).values():  # each file once, where its first shard was committed
            if record.file:
                ranges = files.setdefault(record.file, [])
                ranges.append((record.row_offset, record.row_offset + record.rows))  # type: ignore[union-attr]
            else:
                files[record.shard] = None
        for name, ranges in files.items():
            path = self.shard_path(run_id, name)
            try:
                with self.fs.open_input_file(path) as handle:
                    batches = pq.ParquetFile(handle, page_checksum_verification=True).iter_batches(batch_size=batch_size, columns=columns)
                    yield from batches if ranges is None else _batches_in_ranges(batches, sorted(ranges))
            except (OSError, pa.ArrowException) as error:
                raise self._fail(f"reading shard file {run_id}/{name}", error) from None

    def verify(self, run_id: str) -> list[ShardProblem]:
        """Full check of a run (`factory-store verify s3://...`); every inconsistency is returned (and kept in
        `self.problems`): each live object (a committed shard, or a compacted file) missing, of another size or
        sha256 than its record says, or unreadable, and group ids stored in more than one live object. Every
        record is read again. Shard objects without a record (a commit cut short, members of a compaction not yet
        deleted) are never read, so they are not problems."""
        with self._lock:
            self._runs.pop(run_id, None)
        try:
            cached = self._refresh(run_id)
        except (ValueError, KeyError, TypeError) as error:  # a damaged record: readers of the run fail on it too
            why = f"damaged commit or compaction record: {error}"
            self.problems = [ShardProblem(self._url(run_id, "commits"), why, "bad-line")]
            return self.problems
        with self._lock:
            records = [cached.records[name] for name in cached.order]
            compacted = dict(cached.files)
        live: dict[str, tuple[int | None, str | None, list[tuple[int, int]] | None]] = {}
        for record in records:
            if record.file:
                size, sha256 = compacted.get(record.file, (None, None))
                ranges = live.setdefault(record.file, (size, sha256, []))[2]
                ranges.append((record.row_offset, record.row_offset + record.rows))  # type: ignore[union-attr]
            else:
                live[record.shard] = (record.bytes, record.sha256, None)
        problems: list[ShardProblem] = []
        seen: dict[str, str] = {}
        for name, (size, sha256, ranges) in live.items():
            path = self.shard_path(run_id, name)
            try:
                problem = self._check_object(path, size, sha256)
                if problem is None:
                    with self.fs.open_input_file(path) as handle:
                        ids = pq.read_table(handle, columns=["group_id"]).column(0)
                    ids = _take_ranges(pa.table({"group_id": ids}), sorted(ranges) if ranges is not None else None)
            except (OSError, pa.ArrowException) as error:
                problem = f"unreadable: {' '.join(str(error).split())}"
            if problem is not None:
                problems.append(ShardProblem(self._url(run_id, f"shards/{name}"), problem,
                                             problem.split(" ", 1)[0].rstrip(":")))
                continue
            again: dict[str, int] = {}
            for group_id in ids.column(0).to_pylist():
                if group_id in seen:
                    again[seen[group_id]] = again.get(seen[group_id], 0) + 1
                else:
                    seen[group_id] = name
            for other, count in again.items():
                problems.append(ShardProblem(self._url(run_id, f"shards/{name}"),
                                             f"{count} group ids are also stored in {other} (duplicates)", "duplicate"))
        self.problems = problems
        return problems

    def _url(self, run_id: str, key: str) -> str:
        """s3://bucket/prefix/<run>/<key>, for messages."""
        return f"s3://{self._run(run_id)}/{key}"

    def _check_object(self, path: str, size: int | None, sha256: str | None) -> str | None:
        """None when the object at `path` has the size and sha256 its record says (streamed, 8 MiB at a time)."""
        try:
            handle = self.fs.open_input_stream(path)
        except FileNotFoundError:
            return "missing"
        except OSError as error:
            if "NoSuchKey" in str(error) or "does not exist" in str(error):
                return "missing"
            raise
        digest, total = hashlib.sha256(), 0
        with handle:
            while chunk := handle.read(8 << 20):
                digest.update(chunk)
                total += len(chunk)
        if size is not None and total != size:
            return f"size is {total} bytes, its record says {size} (truncated or overwritten)"
        if sha256 is not None and digest.hexdigest() != sha256:
            return "sha256 differs from its record (corrupt)"
        return None

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


class _RunRecords:
    """The records of one run read so far: each shard's current record (where a compaction moved its rows, that
    file and offset), the order shards were first seen in, and the order they were added or moved in."""

    def __init__(self) -> None:
        self.records: dict[str, CommitRecord] = {}
        self.order: list[str] = []
        self.changed: list[str] = []
        self.compactions: dict[str, str] = {}
        """Compaction records read: merged file -> committed_at."""
        self.files: dict[str, tuple[int | None, str | None]] = {}
        """Merged files: name -> (bytes, sha256) their compaction record says."""

    def put(self, record: CommitRecord) -> None:
        if record.shard not in self.records:
            self.order.append(record.shard)
        self.records[record.shard] = record
        self.changed.append(record.shard)

    def apply_compaction(self, data: dict[str, Any]) -> None:
        """Its members' rows are rows `offset..` of the merged file, in member order. A shard that an earlier
        compaction already moved stays where that one put it (two compactors raced: the first record wins)."""
        name, offset = data["compact"], 0
        self.compactions[name] = data["committed_at"]
        self.files[name] = (data.get("bytes"), data.get("sha256"))
        for member in data["members"]:
            record = CommitRecord.from_dict(member)
            current = self.records.get(record.shard)
            if current is None or not current.file:
                self.put(dataclass_replace(record, file=name, row_offset=offset))
            offset += record.rows


def _parse(data: bytes) -> CommitRecord:
    from factory.store import parse_commit_line

    return parse_commit_line(data)


__all__ = ["ObjectShardStore", "StoreReader", "open_store", "is_store_url"]
