"""Prefect task of the compact flow: one run's compaction (plain function: factory.store_object_compact.compact_store_run)."""

from __future__ import annotations

from typing import Any

from prefect import task

from factory.store_compact import DEFAULT_TARGET_BYTES, main_line
from factory.store_object import open_store
from factory.store_object_compact import compact_store_run


def compact_one_run(store_root: str, run_id: str, target_bytes: int = DEFAULT_TARGET_BYTES, flush: bool = False,
                    workers: int | None = None) -> dict[str, Any]:
    """Compact one run of the store (a directory or s3://bucket/prefix) with `workers` processes writing the merged
    files (None: one per core, factory.store_compact.default_workers); returns the report as a dict (with a one-line
    summary)."""
    report = compact_store_run(open_store(store_root), run_id, target_bytes=target_bytes, flush=flush, workers=workers)
    return {"run_id": run_id, "files": report.files, "shards": report.shards, "rows": report.rows,
            "bytes_in": report.bytes_in, "bytes_out": report.bytes_out, "seconds": report.seconds,
            "mb_per_s": report.mb_per_s, "skipped": report.skipped, "summary": main_line(report)}


# Retries are safe: a compaction interrupted anywhere is finished or left out from the commit log, and a rerun
# merges only shards not merged yet.
compact_run_task = task(compact_one_run, name="compact-run", task_run_name="compact-{run_id}", retries=2, retry_delay_seconds=10)
