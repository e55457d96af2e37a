"""The write-ahead log of posted groups: where a group is durable from the moment its post is answered.

Each chunk of groups the committer takes is one Arrow IPC file, `<chunk>.arrow`, written
beside as a temporary file, fsynced, renamed into place and its directory fsynced; a
half-written chunk is never seen. The chunk later becomes the store's shard of the same
(producer, chunk) and its file is deleted. At start, `recover` commits every chunk still
in the log (a chunk whose shard was already committed is only deleted), so a crash
between the answer and the shard loses nothing and adds nothing twice.

One service writes a (run, producer) log at a time: it holds an exclusive lock on the
log directory from `open` to `close`.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

import pyarrow as pa

from factory.store import ShardStore, fsync_path

logger = logging.getLogger(__name__)


class LogBusy(RuntimeError):
    """Another process holds the log: two services ingest as the same (run, producer)."""


class IngestLog:
    def __init__(self, store: ShardStore, run_id: str, producer: str) -> None:
        self.store, self.run_id, self.producer = store, run_id, producer
        self.directory = store.run_dir(run_id) / "wal" / producer
        self._lock: int | None = None

    def open(self) -> IngestLog:
        self.directory.mkdir(parents=True, exist_ok=True)
        lock = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            raise LogBusy(
                f"another service is ingesting into run {self.run_id!r} as producer {self.producer!r} of store "
                f"{self.store.root}; give this one another ingest_producer (one per service sharing a store)"
            ) from None
        self._lock = lock
        return self

    def close(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # releases the lock
            self._lock = None

    def path(self, chunk: int) -> Path:
        return self.directory / f"{chunk:012d}.arrow"

    def chunks(self) -> list[int]:
        """Chunks in the log, in order."""
        if not self.directory.is_dir():
            return []
        return sorted(int(path.stem) for path in self.directory.glob("*.arrow") if path.stem.isdigit())

    def write(self, chunk: int, groups: pa.Table | pa.RecordBatch) -> None:
        final = self.path(chunk)
        tmp = self.directory / f".{final.name}.tmp"
        with open(tmp, "wb") as handle:
            with pa.ipc.new_file(handle, groups.schema) as writer:
                writer.write(groups)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
        fsync_path(self.directory)

    def read(self, chunk: int) -> pa.Table:
        with pa.OSFile(str(self.path(chunk)), "rb") as source:
            return pa.ipc.open_file(source).read_all()

    def remove(self, chunk: int) -> None:
        self.path(chunk).unlink(missing_ok=True)

    def recover(self, row_group_groups: int) -> int:
        """Commit every chunk left in the log as its shard, then delete it; returns how many groups were committed."""
        for leftover in self.directory.glob(".*.tmp"):
            leftover.unlink(missing_ok=True)
        recovered = 0
        for chunk in self.chunks():
            groups = self.read(chunk)
            record = self.store.commit(self.run_id, self.producer, chunk, groups, row_group_groups=row_group_groups)
            if not record.skipped:
                recovered += groups.num_rows
            self.remove(chunk)
        if recovered:
            logger.info("recovered %d acknowledged groups of run %s from the write-ahead log into shards", recovered, self.run_id)
        return recovered
