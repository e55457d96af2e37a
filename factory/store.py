"""The shard store: crash-safe Parquet shards plus a commit log, the only hand-off between stages.

Layout under `root`::

    <run_id>/shards/<producer>-<chunk:08d>.parquet   committed shards (zstd, page checksums)
    <run_id>/shards/.<name>.<nonce>.tmp               a shard being written (hidden from globbing readers)
    <run_id>/commits.jsonl                            one checksummed line per commit: shard, rows, bytes, sha256

A commit writes a hidden temporary file and fsyncs it and its directory; then,
under the run's lock, it appends the commit record in one checked write and
fsyncs the log (the commit point; see commit_log.py), and only then renames
the shard to its visible name. So a glob reader (`<run>/shards/*.parquet`)
sees exactly the committed shards; a crash or a full disk before the commit
point leaves only a hidden temporary file, and one after it leaves a logged
shard that the next commit (or read) of the run renames into place.
Readers trust the commit log: a shard that is not logged, has the wrong size,
or fails its page checksums is reported with its path and left out.
`verify` finds what is inconsistent and `store_repair.repair` fixes what can be.
Shard names are a pure function of (run, producer, chunk), so a retried or
resumed writer skips (or, asked to, replaces) a chunk instead of duplicating it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from environments.groups import ScoredGroup, describe_validation_error
from factory.commit_log import CommitLineError, LogUncertain, append_line, decode_line, encode_line, fsync_dir, salvage_line
from factory.schema import GROUP_SCHEMA, groups_to_record_batch, record_batch_to_groups

logger = logging.getLogger(__name__)

_NAME_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=-]{0,127}$")
WRITE_BATCH_GROUPS = 64
_SCALAR_COLUMNS = [f.name for f in GROUP_SCHEMA if not pa.types.is_list(f.type)]
PARQUET_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    # Dictionaries and min/max statistics only where they pay: on the scalar columns. On token and logprob
    # lists they cost ~half the encode time and make random token ids bigger, not smaller.
    "use_dictionary": _SCALAR_COLUMNS,
    "write_statistics": _SCALAR_COLUMNS,
}
"""Groups converted to Arrow at a time while writing: bounds the writer's memory."""
READ_BATCH_GROUPS = 64


class StoreError(RuntimeError):
    """A store operation that cannot go on; the message says which path and why.

    `errno` is the OS error behind it (e.g. errno.ENOSPC for a full disk), if any.
    """

    def __init__(self, message: str, errno_: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno_


def _write_failure(what: str, path: Path, error: OSError) -> StoreError:
    hint = " (the disk is full: free space, then rerun)" if error.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return StoreError(f"{what} {path} failed: {error.strerror or error}{hint}", error.errno)


@dataclass(frozen=True)
class CommitRecord:
    """One line of a run's commit log."""

    shard: str
    run_id: str
    producer: str
    chunk: int
    rows: int
    bytes: int
    sha256: str
    committed_at: str
    skipped: bool = field(default=False, compare=False)
    """True when `commit` found the chunk already committed and wrote nothing."""

    def to_json(self) -> str:
        """The record as JSON without a check (the format before checked lines; still read)."""
        record = asdict(self)
        record.pop("skipped")
        return json.dumps(record, sort_keys=True)

    def to_line(self) -> bytes:
        """The record's commit-log line (checksummed, with its newline)."""
        record = asdict(self)
        record.pop("skipped")
        return encode_line(record)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CommitRecord:
        """A record from a parsed line; keys this version does not know are ignored."""
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data and name != "skipped"}
        try:
            return cls(**known)
        except TypeError as error:
            raise CommitLineError(f"not a commit record: {error}") from None


def parse_commit_line(line: bytes) -> CommitRecord:
    """The record of one commit-log line; raises CommitLineError (a ValueError) if it is torn or damaged."""
    return CommitRecord.from_dict(decode_line(line))


class _LogTail:
    """What this process has parsed of one run's commit log: up to `offset` bytes, `lines` lines."""

    TAIL = 64

    def __init__(self, inode: int) -> None:
        self.inode, self.offset, self.lines = inode, 0, 0
        self.records: dict[str, CommitRecord] = {}
        self.bad: list[tuple[int, str, bool]] = []
        """(line number, why, whether a whole record was salvaged from it) of each damaged line."""
        self.torn = 0
        """Bytes after the last newline (a torn last line), as of the last read."""
        self.tail = b""
        """The last bytes parsed: a log rewritten or cut back under us no longer matches them."""


@dataclass(frozen=True)
class ShardProblem:
    """Something in a run that a reader cannot trust, and why (`kind`: missing, size, sha256, unreadable,
    torn-line, bad-line, unlogged, duplicate)."""

    path: str
    reason: str
    kind: str = "shard"


def shard_name(producer: str, chunk: int) -> str:
    """Deterministic file name of a chunk's shard."""
    return f"{producer}-{chunk:08d}.parquet"


def _check_name(kind: str, value: str) -> None:
    if not _NAME_PART.match(value):
        raise ValueError(
            f"{kind} {value!r} is not a valid name: use letters, digits, '_', '-', '.', '=' "
            "(at most 128 characters, starting with a letter or digit)"
        )


fsync_path = fsync_dir
"""fsync a file or a directory by path (a directory's fsync makes a rename inside it durable)."""


def staged_shard(name: str) -> str | None:
    """The shard a hidden temporary file `.<shard>.<nonce>.tmp` is being written for, or None."""
    if not (name.startswith(".") and name.endswith(".tmp")):
        return None
    shard = name[1:].rsplit(".", 2)[0]
    return shard if shard.endswith(".parquet") else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


_VERIFIED: dict[tuple[str, int, int, int], str] = {}


def _verified_sha256(path: Path) -> str:
    """sha256 of a file, remembered per (path, inode, size, mtime) so unchanged shards are hashed once."""
    stat = path.stat()
    key = (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key not in _VERIFIED:
        _VERIFIED[key] = _sha256(path)
    return _VERIFIED[key]


class ShardStore:
    """A directory of runs, each a set of committed Parquet shards of `ScoredGroup`s."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        root_str = os.fspath(root)
        if root_str.startswith("file://"):
            root_str = root_str[len("file://") :]
        if "://" in root_str:
            raise StoreError(
                f"store root {root_str!r} is a URL; the store commits by POSIX rename and fsync, "
                "so point it at a local or mounted (NFS, Lustre, GPFS) directory"
            )
        self.root = Path(root_str).expanduser().absolute()
        self.problems: list[ShardProblem] = []
        """Shards left out of the most recent reads, with the reason."""
        self._logs: dict[str, _LogTail] = {}
        self._logs_lock = threading.Lock()
        self._recovered: set[str] = set()
        """Runs whose interrupted commits this process has finished (once, at its first commit)."""

    # ---- paths ----
    def run_dir(self, run_id: str) -> Path:
        _check_name("run_id", run_id)
        return self.root / run_id

    def shards_dir(self, run_id: str) -> Path:
        return self.run_dir(run_id) / "shards"

    def commit_log(self, run_id: str) -> Path:
        return self.run_dir(run_id) / "commits.jsonl"

    def runs(self) -> list[str]:
        """Runs that have a commit log, sorted by name."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if (p / "commits.jsonl").is_file())

    @contextmanager
    def _locked(self, run_id: str) -> Iterator[None]:
        run_dir = self.run_dir(run_id)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = open(run_dir / ".lock", "a")
        except OSError as error:
            raise _write_failure("opening the lock file", run_dir / ".lock", error) from error
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # ---- writing ----
    def commit(
        self,
        run_id: str,
        producer: str,
        chunk: int,
        groups: Iterable[ScoredGroup | dict[str, Any]],
        *,
        replace: bool = False,
        row_group_groups: int = 256,
    ) -> CommitRecord:
        """Write `groups` as the shard of (run, producer, chunk) and commit it atomically.

        An already committed chunk is skipped (the returned record has
        `skipped=True`) unless `replace` is set. Dicts are validated as
        `ScoredGroup`s; a bad group raises before anything becomes visible.
        An empty chunk commits an empty shard, which marks the chunk done.
        """
        _check_name("producer", producer)
        if chunk < 0:
            raise ValueError(f"chunk must be >= 0, got {chunk}")
        name = shard_name(producer, chunk)
        if not replace and (existing := self.committed(run_id).get(name)) is not None:
            return CommitRecord(**{**asdict(existing), "skipped": True})

        shards = self.shards_dir(run_id)
        if not shards.is_dir():
            try:
                shards.mkdir(parents=True, exist_ok=True)
                fsync_dir(shards.parent)  # the new directory's name is durable before anything in it is committed
            except OSError as error:
                raise _write_failure("creating", shards, error) from error
        tmp = shards / f".{name}.{uuid.uuid4().hex[:12]}.tmp"
        logged = False
        try:
            try:
                rows = self._write_parquet(tmp, groups, row_group_groups)
                size = tmp.stat().st_size
                checksum = _sha256(tmp)
                fsync_dir(shards)  # the temporary's name is durable before a record points at it
            except OSError as error:
                raise _write_failure("writing shard", tmp, error) from error
            record = CommitRecord(
                shard=name,
                run_id=run_id,
                producer=producer,
                chunk=chunk,
                rows=rows,
                bytes=size,
                sha256=checksum,
                committed_at=datetime.now(timezone.utc).isoformat(),
            )
            with self._locked(run_id):
                if not replace and (existing := self.committed(run_id).get(name)) is not None:
                    return CommitRecord(**{**asdict(existing), "skipped": True})
                if run_id not in self._recovered:
                    try:
                        self._finish_commits(run_id)
                        self._recovered.add(run_id)
                    except OSError as error:  # not this commit's business: tried again at the next one
                        logger.error("cannot finish interrupted commits of run %s yet: %s", run_id, error)
                if not tmp.exists():
                    raise StoreError(f"{tmp} vanished before its commit (was `repair` run while writers were active?); retry the chunk")
                try:
                    append_line(self.commit_log(run_id), record.to_line())
                except LogUncertain as error:
                    logged = True  # it may be in the log: keep the temporary, so the commit can still be finished
                    self._forget_log(run_id)
                    raise StoreError(str(error), error.errno) from error
                except OSError as error:
                    self._forget_log(run_id)
                    raise _write_failure("appending the commit record of shard " + name + " to", self.commit_log(run_id), error) from error
                logged = True
                self._publish(tmp, shards / name)
        finally:
            if not logged:
                tmp.unlink(missing_ok=True)
        logger.debug("committed %s (%d groups, %d bytes)", shards / name, rows, size)
        return record

    def _publish(self, tmp: Path, final: Path) -> None:
        """Rename a shard whose record is durable to its visible name (under the run's lock).

        The commit is already durable; a failure here is only logged: the next
        commit of the run in any process (or a reader that misses the shard)
        finishes the rename from the temporary file.
        """
        try:
            os.replace(tmp, final)
        except OSError as error:
            logger.error("shard %s is committed but could not be renamed into place yet (%s); the next commit or read finishes it", final, error)
            self._recovered.discard(final.parent.parent.name)

    def _finish_commits(self, run_id: str) -> list[str]:
        """Rename logged shards still under their temporary name into place (under the run's lock).

        A commit interrupted after its record became durable (a crash, a failed
        rename) left its shard only as `.<shard>.<nonce>.tmp`; the one whose
        size and sha256 match the record is the committed shard. Returns the shards renamed.
        """
        shards = self.shards_dir(run_id)
        try:
            staged = [(entry, staged_shard(entry.name)) for entry in os.scandir(shards) if entry.name.endswith(".tmp")]
        except FileNotFoundError:
            return []
        staged = [(entry, shard) for entry, shard in staged if shard]
        if not staged:
            return []
        records = self.committed(run_id)
        finished = []
        for entry, shard in staged:
            record = records.get(shard)
            final = shards / shard
            if record is None or shard in finished or self._check(final, record, True) is None:
                continue
            tmp = Path(entry.path)
            try:
                if tmp.stat().st_size != record.bytes or _sha256(tmp) != record.sha256:
                    continue
                os.replace(tmp, final)
            except OSError as error:
                logger.error("cannot finish the commit of %s from %s: %s", final, tmp, error)
                continue
            finished.append(shard)
            logger.warning("finished an interrupted commit: renamed %s to %s", tmp.name, final)
        if finished:
            fsync_dir(shards)
        return finished

    def finish_commits(self, run_id: str) -> list[str]:
        """Rename committed shards left under their temporary name (a crash or failed rename) into place."""
        with self._locked(run_id):
            return self._finish_commits(run_id)

    def _forget_log(self, run_id: str) -> None:
        with self._logs_lock:
            self._logs.pop(run_id, None)

    @staticmethod
    def _write_parquet(path: Path, groups: Iterable[ScoredGroup | dict[str, Any]], row_group_groups: int) -> int:
        rows = 0
        pending: list[ScoredGroup] = []
        with open(path, "wb") as handle:
            writer = pq.ParquetWriter(handle, GROUP_SCHEMA, write_page_checksum=True, **PARQUET_OPTIONS)
            try:
                if isinstance(groups, (pa.RecordBatch, pa.Table)):
                    # Rows already in GROUP_SCHEMA (the batching API's ingest path builds them directly).
                    writer.write(groups, row_group_size=row_group_groups)
                    groups, rows = (), groups.num_rows
                for index, group in enumerate(groups):
                    if not isinstance(group, ScoredGroup):
                        try:
                            group = ScoredGroup.model_validate(group)
                        except ValidationError as error:
                            raise ValueError(
                                f"group {index} of the chunk is invalid: {describe_validation_error(error)}"
                            ) from None
                    pending.append(group)
                    if len(pending) >= WRITE_BATCH_GROUPS:
                        writer.write_batch(groups_to_record_batch(pending), row_group_size=row_group_groups)
                        rows += len(pending)
                        pending.clear()
                if pending or rows == 0:
                    writer.write_batch(groups_to_record_batch(pending), row_group_size=row_group_groups)
                    rows += len(pending)
            finally:
                writer.close()
            handle.flush()
            os.fsync(handle.fileno())
        return rows

    def write_run_file(self, run_id: str, name: str, text: str) -> Path:
        """Atomically write a small file next to a run's shards (resolved config, stats)."""
        _check_name("file name", name)
        run_dir = self.run_dir(run_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".{name}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, run_dir / name)
        except OSError as error:
            raise _write_failure("writing", run_dir / name, error) from error
        finally:
            tmp.unlink(missing_ok=True)
        return run_dir / name

    # ---- the commit log ----
    def committed(self, run_id: str) -> dict[str, CommitRecord]:
        """Committed shards of a run by name, in commit order; the latest record of a shard wins.

        The log is append-only, so each call parses only the lines appended since the last call (a
        long-running writer or follower would otherwise re-read a log that grows with every commit).
        """
        return dict(self._read_log(run_id).records)

    def _read_log(self, run_id: str) -> _LogTail:
        log_path = self.commit_log(run_id)
        try:
            stat = log_path.stat()
        except OSError:
            return _LogTail(0)
        with self._logs_lock:
            cached = self._logs.get(run_id)
            if cached is None or cached.inode != stat.st_ino or stat.st_size < cached.offset:
                cached = _LogTail(stat.st_ino)
                self._logs[run_id] = cached
            if stat.st_size > cached.offset:
                with open(log_path, "rb") as log:
                    if cached.offset:
                        log.seek(cached.offset - len(cached.tail))
                        if log.read(len(cached.tail)) != cached.tail:  # cut back and appended to since: start over
                            cached = _LogTail(stat.st_ino)
                            self._logs[run_id] = cached
                            log.seek(0)
                    data = log.read()
                end = data.rfind(b"\n") + 1
                for line in data[:end].splitlines():
                    cached.lines += 1
                    self._parse_line(log_path, cached, line)
                cached.offset += end
                cached.tail = (cached.tail + data[:end])[-_LogTail.TAIL :]
                cached.torn = len(data) - end
                if cached.torn:
                    logger.warning("%s:%d: ignoring a torn last line (crash during append)", log_path, cached.lines + 1)
            return cached

    @staticmethod
    def _parse_line(log_path: Path, cached: _LogTail, line: bytes) -> None:
        if not line.strip():
            return
        try:
            record = parse_commit_line(line)
        except CommitLineError as error:
            salvaged = salvage_line(line)
            cached.bad.append((cached.lines, str(error), salvaged is not None))
            if salvaged is None:
                logger.error("%s:%d: unreadable commit record left out: %s", log_path, cached.lines, error)
                return
            record = CommitRecord.from_dict(salvaged)
            logger.warning("%s:%d: a whole record follows a torn fragment on this line: kept %s", log_path, cached.lines, record.shard)
        cached.records.pop(record.shard, None)
        cached.records[record.shard] = record

    def is_committed(self, run_id: str, producer: str, chunk: int) -> bool:
        return shard_name(producer, chunk) in self.committed(run_id)

    # ---- reading ----
    def shard_paths(self, run_id: str, *, checksum: bool = True) -> list[Path]:
        """Paths of a run's committed, intact shards in commit order.

        Each is checked against its logged size and sha256 (a file already
        verified in this process, unchanged since, is not hashed again);
        problems go to `self.problems` and the log, and the shard is left out.
        `checksum=False` checks sizes only, for callers that re-list often.
        """
        self.problems = []
        paths = []
        shards = self.shards_dir(run_id)
        finished = False
        for record in self.committed(run_id).values():
            path = shards / record.shard
            problem = self._check(path, record, checksum)
            if problem and not finished:
                # A commit in flight (its record is durable, the rename is next) or interrupted: wait for the
                # writer's lock and finish it if it was interrupted. Read-only stores just report it.
                finished = True
                try:
                    with self._locked(run_id):
                        self._finish_commits(run_id)
                except (OSError, StoreError):  # a read-only store: report the shard below
                    pass
                problem = self._check(path, record, checksum)
            if problem:
                self.problems.append(ShardProblem(str(path), problem, problem.split(" ", 1)[0]))
                logger.error("shard %s left out of reads: %s", path, problem)
            else:
                paths.append(path)
        return paths

    @staticmethod
    def _check(path: Path, record: CommitRecord, checksum: bool) -> str | None:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return "missing"
        if size != record.bytes:
            return f"size is {size} bytes, commit log says {record.bytes} (truncated or overwritten)"
        if checksum and _verified_sha256(path) != record.sha256:
            return "sha256 differs from the commit log (corrupt)"
        return None

    def verify(self, run_id: str) -> list[ShardProblem]:
        """Full check of a run; every inconsistency is returned (and kept in `self.problems`).

        Finds damaged or torn commit-log lines, logged shards that are missing,
        of the wrong size or sha256, or unreadable, shards under the glob
        (`shards/*.parquet`) that no record commits, and group ids stored in
        more than one committed shard. `store_repair.repair` fixes what can be fixed.
        """
        _VERIFIED.clear()
        self._forget_log(run_id)
        log = self._read_log(run_id)
        problems = [
            ShardProblem(
                f"{self.commit_log(run_id)}:{line}",
                f"damaged commit record: {why}" + (" (a whole record after the fragment was kept)" if salvaged else ""),
                "bad-line",
            )
            for line, why, salvaged in log.bad
        ]
        if log.torn:
            problems.append(ShardProblem(
                f"{self.commit_log(run_id)}:{log.lines + 1}", f"torn last line of {log.torn} bytes (an interrupted append)", "torn-line"
            ))
        paths = self.shard_paths(run_id)
        problems += self.problems
        seen: dict[str, str] = {}
        for path in paths:
            try:
                ids = pq.read_table(path, columns=["group_id"]).column(0).to_pylist()
            except (OSError, pa.ArrowException) as error:
                problems.append(ShardProblem(str(path), f"unreadable Parquet: {error}", "unreadable"))
                continue
            again: dict[str, int] = {}
            for group_id in ids:
                if group_id in seen:
                    again[seen[group_id]] = again.get(seen[group_id], 0) + 1
                else:
                    seen[group_id] = path.name
            for other, count in again.items():
                problems.append(ShardProblem(str(path), f"{count} group ids are also stored in {other} (duplicates)", "duplicate"))
        logged = set(log.records)
        shards = self.shards_dir(run_id)
        if shards.is_dir():
            for path in sorted(shards.glob("*.parquet")):
                if path.name not in logged:
                    problems.append(ShardProblem(str(path), "not in the commit log, yet seen by glob readers (unlogged)", "unlogged"))
        for problem in problems:
            if problem not in self.problems:
                logger.error("%s: %s", problem.path, problem.reason)
        self.problems = problems
        return problems

    def iter_batches(
        self, run_id: str, *, columns: list[str] | None = None, batch_size: int = READ_BATCH_GROUPS
    ) -> Iterator[pa.RecordBatch]:
        """Stream a run's groups as Arrow record batches, one shard at a time.

        A shard whose pages fail their checksums is reported and skipped
        whole; batches already yielded from it are not taken back, so callers
        that need all-or-nothing per shard should use `iter_shard_batches`.
        """
        for path in self.shard_paths(run_id):
            yield from self._read_shard(path, columns, batch_size)

    def iter_shard_batches(
        self, path: Path, *, columns: list[str] | None = None, batch_size: int = READ_BATCH_GROUPS
    ) -> Iterator[pa.RecordBatch]:
        yield from self._read_shard(path, columns, batch_size)

    def _read_shard(self, path: Path, columns: list[str] | None, batch_size: int) -> Iterator[pa.RecordBatch]:
        try:
            parquet = pq.ParquetFile(path, page_checksum_verification=True)
            yield from parquet.iter_batches(batch_size=batch_size, columns=columns)
        except (OSError, pa.ArrowException) as error:
            problem = ShardProblem(str(path), f"unreadable: {error}")
            self.problems.append(problem)
            logger.error("shard %s left out of reads: %s", path, problem.reason)

    def iter_groups(self, run_id: str, *, validate: bool = False) -> Iterator[ScoredGroup]:
        """Stream a run's groups as `ScoredGroup`s in commit order."""
        for batch in self.iter_batches(run_id):
            yield from record_batch_to_groups(batch, validate=validate)

    def dataset(self, run_id: str) -> Any:
        """A `pyarrow.dataset` over the run's committed, intact shards."""
        import pyarrow.dataset as ds  # imported here: it pulls in pandas (~0.15 s), which nothing else of the store needs

        return ds.dataset([str(p) for p in self.shard_paths(run_id)], schema=GROUP_SCHEMA, format="parquet")

    def count(self, run_id: str) -> int:
        """Groups committed in a run (from the commit log; no shard is opened)."""
        return sum(record.rows for record in self.committed(run_id).values())
