"""`factory-store verify|repair|compact ROOT [RUN ...]`: check a store's runs, fix what can be fixed, or merge small shards.

Exit status 0 when every run checked is consistent (after repair, for
`repair`), 1 when problems remain, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys

from factory.cli_errors import run_cli
from factory.store import ShardStore, StoreError
from factory.store_compact import compact_run, main_line
from factory.store_object import is_store_url, open_store
from factory.store_repair import DEFAULT_STALE_TMP_S, repair


def main(argv: list[str] | None = None) -> int:
    """The console script; user errors (a missing bucket or credentials, ...) end with one line."""
    return run_cli("factory-store", _main, argv)


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="factory-store", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["verify", "repair", "compact"])
    parser.add_argument("root", help="the store's root directory (verify and compact also take s3://bucket/prefix)")
    parser.add_argument("runs", nargs="*", help="run ids (default: every run in the store)")
    parser.add_argument("--stale-tmp-s", type=float, default=DEFAULT_STALE_TMP_S,
                        help="repair: delete temporary files older than this many seconds (default %(default)s)")
    parser.add_argument("--target-mb", type=float, default=256, help="compact: size of the merged files (default %(default)s)")
    parser.add_argument("--flush", action="store_true", help="compact: also merge a last batch under the target size")
    parser.add_argument("--workers", type=int, default=None,
                        help="compact: processes writing merged files (default: one per core, at most 4; 1: one process)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    if is_store_url(args.root):
        return _object_store(args)
    store = ShardStore(args.root)
    runs = args.runs or store.runs()
    if not runs:
        print(f"no runs under {store.root} (a run is a directory with a commits.jsonl)", file=sys.stderr)
        return 1
    bad = 0
    for run_id in runs:
        if not store.commit_log(run_id).exists():
            print(f"{run_id}: no commit log at {store.commit_log(run_id)}; is {store.root} the store's root?")
            bad += 1
            continue
        if args.command == "compact":
            try:
                print(main_line(compact_run(store, run_id, target_bytes=int(args.target_mb * (1 << 20)), flush=args.flush,
                                             workers=args.workers)))
            except (StoreError, OSError) as error:
                print(f"factory-store: error: {error}", file=sys.stderr)
                bad += 1
            continue
        if args.command == "repair":
            report = repair(store, run_id, stale_tmp_s=args.stale_tmp_s)
            for action in report.actions:
                print(f"{run_id}: repaired: {action}")
            problems = report.remaining
        else:
            problems = store.verify(run_id)
        for problem in problems:
            print(f"{run_id}: {problem.kind}: {problem.path}: {problem.reason}")
        groups = store.count(run_id)
        print(f"{run_id}: {len(store.committed(run_id))} committed shards, {groups} groups, "
              + ("consistent" if not problems else f"{len(problems)} problems"))
        bad += bool(problems)
    return 1 if bad else 0


def _object_store(args: argparse.Namespace) -> int:
    """verify or compact on an object store (repair reads a local log and directory)."""
    from factory.store_object_compact import compact_object_run

    if args.command == "repair":
        print(f"factory-store: error: repair works on a local or shared store root; on {args.root} verify and "
              "compact are available", file=sys.stderr)
        return 2
    store = open_store(args.root)
    known = store.runs()
    bad = 0
    for run_id in args.runs or known:
        if run_id not in known:
            print(f"{run_id}: no such run in {args.root}; runs there: {known or 'none'}")
            bad += 1
            continue
        if args.command == "verify":
            problems = store.verify(run_id)
            for problem in problems:
                print(f"{run_id}: {problem.kind}: {problem.path}: {problem.reason}")
            counts = "" if any(p.kind == "bad-line" for p in problems) else (  # no counts past a damaged record
                f"{len(store.committed(run_id))} committed shards, {store.count(run_id)} groups, ")
            print(f"{run_id}: {counts}" + ("consistent" if not problems else f"{len(problems)} problems"))
            bad += bool(problems)
            continue
        print(main_line(compact_object_run(store, run_id, target_bytes=int(args.target_mb * (1 << 20)), flush=args.flush)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
