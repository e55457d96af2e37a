"""Where a run-api commit's CPU goes: the fixed part of a shard commit and the parts of it, in process.

Commits shards of 1, 8 and 64 of the bench's posted groups (bench.serve.run's make_groups: 8 x 1024 tokens,
as Arrow rows the way the run-api hands them to `ShardStore.commit`) and reports the median thread CPU per
commit, a fixed + per-group fit, minor page faults per commit, and then each step of the commit (and of the
service's `_on_commit`) done on its own, in the same order, with its median thread CPU. `--malloc` first applies
the run-api's allocator settings (factory/serve/memory.py: a fixed 1 MiB mmap threshold), as the server runs.

    python -m bench.serve.commit_parts --smoke
    OMP_NUM_THREADS=1 python -m bench.serve.commit_parts --malloc --reps 40
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

COUNTS = (1, 8, 64)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(reps: int, seq_len: int, malloc: bool = False) -> dict[str, Any]:
    if malloc:
        from factory.serve.ingest import limit_allocator_growth

        limit_allocator_growth()
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bench.serve.run import make_groups
    from factory.commit_log import append_line, fsync_dir
    from factory.index_runs import summarize_table
    from factory.schema import GROUP_SCHEMA, ScoredGroup, groups_to_record_batch
    from factory.serve.state import ServedState
    from factory.store import PARQUET_OPTIONS, CommitRecord, ShardStore

    clock = time.thread_time
    raw = make_groups(max(COUNTS), seq_len=seq_len)
    tables = {}
    for count in COUNTS:
        groups = [ScoredGroup.model_validate(group) for group in raw[:count]]
        for group in groups:
            group.run_id = "bench"
        tables[count] = pa.Table.from_batches([groups_to_record_batch(groups)])
    result: dict[str, Any] = {"commit": {}, "parts": {}}
    with tempfile.TemporaryDirectory(prefix="commit-parts-") as root_name:
        root = Path(root_name)
        store, state = ShardStore(root), ServedState(root / "state.db")
        chunk = 0
        for count in COUNTS:  # first commits (directory creation, first imports) are not counted
            chunk += 1
            store.commit("bench", "p", chunk, tables[count], row_group_groups=16)
        for count in COUNTS:
            runs = reps if count < 64 else max(2, reps // 4)
            cpus, faults = [], _faults()
            for _ in range(runs):
                chunk += 1
                start = clock()
                store.commit("bench", "p", chunk, tables[count], row_group_groups=16)
                cpus.append(clock() - start)
            result["commit"][count] = {"cpu_ms": 1e3 * statistics.median(cpus), "faults": (_faults() - faults) / runs}

        for count in COUNTS:
            table, parts = tables[count], defaultdict(list)
            runs = reps if count < 64 else max(2, reps // 4)

            def timed(name: str, step: Any) -> Any:
                faults, start = _faults(), clock()
                value = step()
                parts[name].append((clock() - start, _faults() - faults))
                return value

            for _ in range(runs):
                tmp = store.shards_dir("bench") / f".part.{uuid.uuid4().hex[:12]}.tmp"
                timed("log lookup (x3 per commit)", lambda: store.record("bench", "none"))

                def encode() -> memoryview:
                    sink = pa.BufferOutputStream()
                    with pq.ParquetWriter(sink, GROUP_SCHEMA, write_page_checksum=True, **PARQUET_OPTIONS) as writer:
                        writer.write(table, row_group_size=16)
                    return memoryview(sink.getvalue())

                data = timed("Parquet encode", encode)
                timed("sha256", lambda: hashlib.sha256(data).hexdigest())
                fd = timed("open + write", lambda: (fd := os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666),
                                                    os.write(fd, data))[0])
                timed("fsync shard + close", lambda: (os.fsync(fd), os.close(fd)))
                timed("fsync directory", lambda: fsync_dir(tmp.parent))
                line = timed("summarize_table + record + JSON line", lambda: CommitRecord(
                    shard="part", run_id="bench", producer="p", chunk=0, rows=count, bytes=len(data), sha256="0" * 64,
                    committed_at=datetime.now(timezone.utc).isoformat(), index=summarize_table(table)).to_line())

                def lock() -> None:
                    with store._locked("bench"):
                        pass

                timed("lock file open + flock", lock)
                timed("append + fsync a log line", lambda: append_line(root / "side.jsonl", line))
                timed("rename", lambda: os.replace(tmp, tmp.with_name(tmp.name + ".done")))
                ids = table.column("group_id").to_pylist()
                timed("on_commit: columns to Python", lambda: table.select(
                    ["group_id", "group_size", "env", "env_id", "policy_version"]).to_pydict())
                timed("on_commit: state add_source + put (SQLite)", lambda: (
                    state.add_source("bench", uuid.uuid4().hex, count, ids), state.put(ingested={"bench": count})))
            result["parts"][count] = {name: {"cpu_ms": 1e3 * statistics.median(v[0] for v in values),
                                             "faults": statistics.mean(v[1] for v in values)}
                                      for name, values in parts.items()}
        state.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=40, help="commits per group count (a quarter of it for 64)")
    parser.add_argument("--malloc", action="store_true", help="the run-api's allocator settings first")
    parser.add_argument("--smoke", action="store_true", help="3 reps, 64-token sequences")
    args = parser.parse_args(argv)
    reps, seq_len = (3, 64) if args.smoke else (args.reps, 1024)
    result = measure(reps, seq_len, args.malloc)
    commit = result["commit"]
    print("| groups per commit | commit CPU ms (median) | per group | minor faults |\n|---:|---:|---:|---:|")
    for count, row in commit.items():
        print(f"| {count} | {row['cpu_ms']:.3f} | {row['cpu_ms'] / count:.3f} | {row['faults']:.0f} |")
    slope = (commit[8]["cpu_ms"] - commit[1]["cpu_ms"]) / 7
    print(f"\nfit on 1 and 8 groups: {commit[1]['cpu_ms'] - slope:.3f} ms fixed per commit + {slope:.3f} ms per group; "
          f"on 8 and 64: {(commit[64]['cpu_ms'] - commit[8]['cpu_ms']) / 56:.3f} ms per group\n")
    names = list(result["parts"][1])
    print("| step (thread CPU ms, median) | " + " | ".join(f"{c} groups" for c in COUNTS) + " |")
    print("|---|" + "---:|" * len(COUNTS))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{result['parts'][c][name]['cpu_ms']:.3f}" for c in COUNTS) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
