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

What it cannot fix is reported, unchanged: logged shards that are missing or
corrupt (their groups are lost unless a copy exists elsewhere) and group ids
stored in more than one shard (removing a copy rewrites a shard, whose row
positions run-api's served state refers to).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from factory.commit_log import CommitLineError, fsync_dir, salvage_line
from factory.store import CommitRecord, ShardProblem, ShardStore, parse_commit_line, staged_shard

DEFAULT_STALE_TMP_S = 3600.0


@dataclass
class RepairReport:
    """What `repair` changed in one run, and what is still wrong after it."""

    run_id: str
    actions: list[str] = field(default_factory=list)
    remaining: list[ShardProblem] = field(default_factory=list)


def repair(store: ShardStore, run_id: str, *, stale_tmp_s: float = DEFAULT_STALE_TMP_S) -> RepairReport:
    """Repair one run of `store` (see the module docstring) and verify it again."""
    report = RepairReport(run_id)
    with store._locked(run_id):
        _repair_log(store, run_id, report)
        for shard in store._finish_commits(run_id):
            report.actions.append(f"finished the interrupted commit of {shard} (renamed from its temporary file)")
        _hide_unlogged(store, run_id, report)
        _remove_stale_temporaries(store, run_id, stale_tmp_s, report)
    report.remaining = store.verify(run_id)
    return report


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
