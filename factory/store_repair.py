"""`repair`: fix what `ShardStore.verify` finds, where it can be fixed without losing a committed group.

What it does, under the run's lock (stop the run's writers first: a
temporary file of a writer still working would otherwise look stale):

- damaged commit-log lines: a whole record that follows a torn fragment (a
  log written before torn tails were cut off) is kept, re-written as a checked
  line; a fragment is removed from the log and kept in `commits.jsonl.damaged`;
  a torn last line is cut off (or completed, if it is a whole record). The
  log is rewritten to a temporary file and renamed over the old one.
- logged shards still under their temporary name (a commit interrupted after
  its record was durable) are renamed into place.
- shards under `shards/*.parquet` that no record commits (left by writers
  before commits were made visible only after their record) are moved to
  `<run>/unlogged/`, out of glob readers' sight, not deleted.
- temporary files older than `stale_tmp_s` that no record needs are deleted.

- group ids stored more than once (in two shards, or twice in one): the
  first copy in commit order is kept; each later shard holding a copy is
  rewritten without it and committed again under its own name (a new
  commit record replaces the old one; the data is verified before the old
  record stops counting). Stop run-api instances following the run first:
  they refer to rows by position, and the rows after a removed copy move up.

What it cannot fix is reported, unchanged: logged shards that are missing or
corrupt (their groups are lost unless a copy exists elsewhere).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from factory.commit_log import CommitLineError, fsync_dir, salvage_line
from factory.schema import GROUP_SCHEMA
from factory.store import CommitRecord, ShardProblem, ShardStore, parse_commit_line, staged_shard

DEFAULT_STALE_TMP_S = 3600.0


@dataclass
class RepairReport:
    """What `repair` changed in one run, and what is still wrong after it."""

    run_id: str
    actions: list[str] = field(default_factory=list)
    remaining: list[ShardProblem] = field(default_factory=list)


def repair(store: ShardStore, run_id: str, *, stale_tmp_s: float = DEFAULT_STALE_TMP_S, dedupe: bool = True) -> RepairReport:
    """Repair one run of `store` (see the module docstring) and verify it again."""
    report = RepairReport(run_id)
    with store._locked(run_id):
        _repair_log(store, run_id, report)
        for shard in store._finish_commits(run_id, remove_retired=False):
            report.actions.append(f"finished the interrupted commit of {shard} (renamed from its temporary file)")
        for shard in store._remove_retired(run_id):
            report.actions.append(f"removed {shard}: a logged compaction merged its rows into another file")
        _hide_unlogged(store, run_id, report)
        _remove_stale_temporaries(store, run_id, stale_tmp_s, report)
    if dedupe:
        _remove_duplicates(store, run_id, report)  # commits, so outside the lock (commit takes it)
    report.remaining = store.verify(run_id)
    return report


def _remove_duplicates(store: ShardStore, run_id: str, report: RepairReport) -> None:
    """Rewrite each shard that holds a group id already stored earlier (in commit order) without those rows."""
    seen: set[str] = set()
    shards = store.shards_dir(run_id)
    for record in list(store.committed(run_id).values()):
        path = shards / record.physical
        damaged = not path.exists() if record.file else store._check(path, record, True) is not None
        if damaged:
            continue  # missing or damaged: verify reports it; its ids are not counted as stored
        try:
            table = pq.read_table(path).slice(record.row_offset, record.rows)
        except (OSError, pa.ArrowException):
            continue
        ids = table.column("group_id").to_pylist()
        keep = []
        for group_id in ids:
            keep.append(group_id not in seen)
            seen.add(group_id)
        if all(keep):
            continue
        kept = table.filter(pa.array(keep))
        store.commit(run_id, record.producer, record.chunk, kept.cast(GROUP_SCHEMA), replace=True)
        report.actions.append(
            f"rewrote {record.shard} without {len(ids) - kept.num_rows} group ids stored earlier (kept {kept.num_rows} rows)"
        )


def _repair_log(store: ShardStore, run_id: str, report: RepairReport) -> None:
    path = store.commit_log(run_id)
    if not path.exists():
        return
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the log ends with a newline
    kept: list[bytes] = []
    damaged: list[bytes] = []
    changed = False
    for number, line in enumerate(lines, 1):
        if not line.strip():
            changed = True
            continue
        try:
            parse_commit_line(line)
            kept.append(line + b"\n")
            continue
        except CommitLineError:
            changed = True
        salvaged = salvage_line(line)
        damaged.append(line + b"\n")
        if salvaged is not None:
            record = CommitRecord.from_dict(salvaged)
            kept.append(record.to_line())
            report.actions.append(f"commit log line {number}: kept the record of {record.shard} that followed a torn fragment")
        else:
            report.actions.append(f"commit log line {number}: moved an unreadable fragment to {path.name}.damaged")
    if tail:
        changed = True
        try:
            parse_commit_line(tail)
            kept.append(tail + b"\n")
            report.actions.append(f"commit log line {len(lines) + 1}: completed a whole last record that lacked its newline")
        except CommitLineError:
            damaged.append(tail + b"\n")
            report.actions.append(f"commit log line {len(lines) + 1}: cut off a torn last line ({len(tail)} bytes)")
    if not changed:
        return
    if damaged:
        with open(path.with_name(path.name + ".damaged"), "ab") as handle:
            handle.writelines(damaged)
            handle.flush()
            os.fsync(handle.fileno())
    tmp = path.with_name(f".{path.name}.repair.tmp")
    with open(tmp, "wb") as handle:
        handle.writelines(kept)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    store._forget_log(run_id)


def _hide_unlogged(store: ShardStore, run_id: str, report: RepairReport) -> None:
    shards = store.shards_dir(run_id)
    if not shards.is_dir():
        return
    logged = store.committed(run_id)
    unlogged = [path for path in sorted(shards.glob("*.parquet")) if path.name not in logged]
    if not unlogged:
        return
    aside = store.run_dir(run_id) / "unlogged"
    aside.mkdir(exist_ok=True)
    for path in unlogged:
        target = aside / path.name
        if target.exists():
            target = aside / f"{path.stem}.{int(time.time())}{path.suffix}"
        os.replace(path, target)
        report.actions.append(f"moved unlogged shard {path.name} to {target} (out of glob readers' sight)")
    fsync_dir(shards)
    fsync_dir(aside)


def _remove_stale_temporaries(store: ShardStore, run_id: str, stale_tmp_s: float, report: RepairReport) -> None:
    now = time.time()
    for folder in (store.shards_dir(run_id), store.run_dir(run_id)):
        if not folder.is_dir():
            continue
        for entry in os.scandir(folder):
            if not (entry.name.startswith(".") and entry.name.endswith(".tmp")):
                continue
            age = now - entry.stat().st_mtime
            if age < stale_tmp_s:
                continue
            if staged_shard(entry.name) in store.committed(run_id) and not (folder / staged_shard(entry.name)).exists():
                continue  # still the only copy of a committed shard (a rename that failed): never delete it
            Path(entry.path).unlink(missing_ok=True)
            report.actions.append(f"removed stale temporary file {entry.path} ({age:.0f} s old)")
