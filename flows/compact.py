"""`compact`: merge the small shards of a store's runs into larger files, beside live datagen and serving.

    python -m flows.compact --store-root data/store --runs run-1 run-2 --target-mb 256
    python -m flows.compact --store-root data/store --flush      # every run, including a last file under target
    python -m flows.compact --store-root s3://bucket/store --runs run-1   # an object store (factory/store_object_compact.py)
    python -m flows.compact --store-root data/store --workers 1  # all in one process (default: a worker per core)

Each run's merge is recorded in its commit log (factory/store_compact.py): readers see every group once before,
during and after, a kill at any point is finished or undone by the next reader, and run-api's served state (keyed
by shard and row) stays right; a run-api following a compacted run reads the merged files once its follower sees the
compaction (no restart).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from prefect import flow, get_run_logger

from factory.store import StoreError
from factory.store_object import open_store
from tasks.compact import compact_run_task


@flow(name="compact", log_prints=False)
def compact(store_root: str, runs: list[str] | None = None, target_mb: int = 256, flush: bool = False,
            workers: int | None = None) -> list[dict[str, Any]]:
    """Compact `runs` of the store (default: every run) into files of about `target_mb`, written by `workers`
    processes (None: one per core, at most 4; 1: in the task's own process); returns one report per run."""
    logger = get_run_logger()
    store = open_store(store_root)
    known = store.runs()
    names = runs or known
    missing = [run for run in names if run not in known]
    if missing:
        raise StoreError(f"run(s) {missing} have no commit log under {store.root}; runs there: {store.runs() or 'none'}")
    if not names:
        logger.warning("no runs under %s: nothing to compact (is store_root the datagen runs' store?)", store.root)
    reports = []
    for run in names:
        report = compact_run_task(store_root, run, target_bytes=target_mb << 20, flush=flush, workers=workers)
        logger.info("%s", report["summary"])
        reports.append(report)
    return reports


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flows.compact", description=__doc__.split("\n\n")[0])
    parser.add_argument("--store-root", required=True)
    parser.add_argument("--runs", nargs="*", default=None)
    parser.add_argument("--target-mb", type=int, default=256)
    parser.add_argument("--flush", action="store_true", help="also merge a last batch smaller than the target")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes writing merged files (default: one per core, at most 4; 1: one process)")
    args = parser.parse_args(argv)
    compact(args.store_root, args.runs, args.target_mb, args.flush, args.workers)


if __name__ == "__main__":
    from factory.cli_errors import run_cli

    sys.exit(run_cli("flows.compact", main, sys.argv[1:]))
