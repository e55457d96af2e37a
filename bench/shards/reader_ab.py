"""The viewer's first page and an export's first group on one compacted store, two code trees interleaved (A, B,
A, B ...): issue 34's "export and viewer cost independent of unrelated history" as a ratio on a noisy machine.

    python -m bench.shards.reader_ab --shards 100000 --a /tmp/old-tree --b . --rounds 3
    python -m bench.shards.reader_ab --smoke          # 300 shards, this tree against itself, 1 round
    python -m bench.shards.reader_ab --shards 200000 --no-compact --a /tmp/old-tree --b . --rounds 3

The store is built with this tree's bench.shards.scale (10 groups of 4 x 64 tokens per shard), compacted to
128 MB files and checkpointed (as `compact_run` does), then `--tail` shards of another producer are committed
after the manifest (a live run goes on after a compaction); `--no-compact`: the store as built (every shard its own
file, the manifest checkpointed by the build, a row per shard), the `--tail` shards after it. Each measurement is a fresh process with PYTHONPATH
set to the tree under test (a cold start, as a new view-run or export is; the store's files are in the page cache):
- viewer: a new `RunIndex` refreshed with the viewer's 0.5 s budget (`--budget`; 0: the log read and one step of
  indexing, what the run's history costs a first page), then the newest 50 rows read (what the run page shows
  first); groups indexed within the budget;
- export: the store source of an export (`iter_store_groups`, metadata columns) until its first group, and then
  until `--export-groups` groups (time to first group, groups/s).
CPU seconds (user + system) are given beside wall seconds. Both trees must show the same newest rows and
export the same groups (a hash of their ids) or the bench stops (the viewer: the newest rows both indexed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_MEASURE = """
import hashlib, json, resource, sys, time
begin = time.perf_counter()
root, what, limit, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])

def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

if what == "viewer":
    from factory.store import ShardStore
    from factory.viewer.index import RunIndex
    index = RunIndex(ShardStore(root), "gen")
    index.refresh(budget_s=budget)
    frame = index.frame
    rows = index.read_rows(frame.tail(50).reverse(), ["group_id", "item_key"])
    out = {"s": time.perf_counter() - begin, "cpu_s": cpu(), "indexed_groups": frame.height,
           "pending_shards": index.pending, "rows": [row["group_id"] + " " + row["item_key"] for row in rows]}
else:
    from factory.export.config import SourceConfig
    from factory.export.source import iter_store_groups
    groups = iter_store_groups(SourceConfig(store=root, runs=["gen"]), need_tokens=False)
    ids = [next(groups).group_id]
    first, first_cpu = time.perf_counter() - begin, cpu()
    for group in groups:
        ids.append(group.group_id)
        if len(ids) >= limit:
            break
    seconds = time.perf_counter() - begin
    out = {"s": first, "cpu_s": first_cpu, "groups": len(ids), "groups_per_s": len(ids) / seconds,
           "hash": hashlib.sha256("\\n".join(ids).encode()).hexdigest()[:16]}
print(json.dumps(out))
"""


def measure(tree: str, root: Path, what: str, limit: int, budget: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(root), what, str(limit), str(budget)], env=env, check=True,
                         capture_output=True, text=True, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def build(root: Path, shards: int, tail: int, no_compact: bool = False) -> None:
    from bench.shards.scale import GROUPS_PER_SHARD, RUN, build_store, compact
    from factory.store import ShardStore
    from factory.store_compact import checkpoint
    from factory.synthetic import synthetic_groups

    built = build_store(root, shards)
    print(f"# built {shards} shards ({built['bytes'] / 1e6:.0f} MB) in {built['seconds']:.0f} s, {_now()}", flush=True)
    done = {"compact_files": 0, "compact_s": 0.0} if no_compact else compact(str(root), 128)
    store = ShardStore(root)
    if not no_compact:
        checkpoint(store, RUN)
    for chunk in range(tail):
        store.commit(RUN, "w1", chunk, synthetic_groups(GROUPS_PER_SHARD, start=10**8 + chunk * 100, group_size=4,
                                                        seq_len=64, env="bench"))
    print(f"# compacted into {done['compact_files']} files in {done['compact_s']:.0f} s, {tail} shards committed "
          f"after, {_now()}", flush=True)


def _now() -> str:
    return f"{time.strftime('%H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()[0]:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--a", default=".", help="code tree A (e.g. an export of main)")
    parser.add_argument("--b", default=".", help="code tree B")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tail", type=int, default=5, help="shards committed after the compaction's manifest")
    parser.add_argument("--export-groups", type=int, default=200_000)
    parser.add_argument("--budget", type=float, default=0.5,
                        help="the viewer's indexing budget (0: the log read and the newest row group alone)")
    parser.add_argument("--dir", default=None, help="scratch directory (the store is kept there if given)")
    parser.add_argument("--no-compact", action="store_true", help="measure the store as built (no compaction)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shards, args.rounds, args.export_groups = 300, 1, 1000
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="reader-ab-"))
    root = scratch / f"store-{args.shards}"
    try:
        if not root.exists():
            build(root, args.shards, args.tail, args.no_compact)
        times: dict[str, list[dict]] = {f"{label} {what}": [] for label in "AB" for what in ("viewer", "export")}
        for round_ in range(args.rounds):
            order = ("A", "B") if round_ % 2 == 0 else ("B", "A")
            for what in ("viewer", "export"):
                hashes = {}
                for label in order:
                    result = measure(args.a if label == "A" else args.b, root, what, args.export_groups, args.budget)
                    times[f"{label} {what}"].append(result)
                    hashes[label] = result.pop("hash", None) or result.pop("rows")
                    extra = (f"{result['indexed_groups']} groups indexed, {result['pending_shards']} shards pending"
                             if what == "viewer" else f"{result['groups_per_s']:,.0f} groups/s over {result['groups']}")
                    print(f"round {round_} {label} {what}: {result['s']:.2f} s ({result['cpu_s']:.2f} s CPU), {extra}; "
                          f"{_now()}", flush=True)
                if what == "viewer":  # the newest rows that both indexed within the budget
                    shown = min(len(hashes["A"]), len(hashes["B"]))
                    hashes = {label: rows[:shown] for label, rows in hashes.items()}
                if hashes["A"] != hashes["B"]:
                    raise SystemExit(f"{what}: A and B differ ({hashes})")
        print(f"\n| shards | what | A s (CPU s) | B s (CPU s) | median A/B | groups indexed A / B |")
        print("|---:|---|---|---|---:|---|")
        for what in ("viewer", "export"):
            a, b = times[f"A {what}"], times[f"B {what}"]
            cells = [", ".join(f"{r['s']:.2f} ({r['cpu_s']:.2f})" for r in side) for side in (a, b)]
            ratio = statistics.median(r["s"] for r in a) / statistics.median(r["s"] for r in b)
            name = f"viewer first page (budget {args.budget:g} s)" if what == "viewer" else "export first group"
            indexed = (" / ".join(", ".join(str(r["indexed_groups"]) for r in side) for side in (a, b))
                       if what == "viewer" else "-")
            print(f"| {args.shards:,} | {name} | {cells[0]} | {cells[1]} | {ratio:.2f}x | {indexed} |")
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
