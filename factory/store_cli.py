"""`factory-store verify|repair ROOT [RUN ...]`: check a store's runs, or fix what can be fixed.

Exit status 0 when every run checked is consistent (after repair, for
`repair`), 1 when problems remain, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys

from factory.store import ShardStore
from factory.store_repair import DEFAULT_STALE_TMP_S, repair


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="factory-store", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["verify", "repair"])
    parser.add_argument("root", help="the store's root directory")
    parser.add_argument("runs", nargs="*", help="run ids (default: every run in the store)")
    parser.add_argument("--stale-tmp-s", type=float, default=DEFAULT_STALE_TMP_S,
                        help="repair: delete temporary files older than this many seconds (default %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
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


if __name__ == "__main__":
    sys.exit(main())
