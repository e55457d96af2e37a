"""Compaction throughput and the viewer's first page before and after it, two code trees interleaved (issue 34):
each trial builds a fresh store (this tree's bench.shards.scale.build_store), writes it to disk (`sync`: members
of a real compaction are old files, and removing a file whose blocks are on disk costs far more than removing one
still in the page cache), then, each step in its own process with PYTHONPATH set to the tree under test:
the viewer's first page, the compaction (128 MB files), the viewer's first page again.

    python -m bench.shards.compact_ab --shards 20000 --a /tmp/old-tree --b . --rounds 2
    python -m bench.shards.compact_ab --smoke         # 300 shards, this tree against itself, 1 round
    python -m bench.shards.compact_ab --preset rl --shards 2000 --a /tmp/old-tree --b .
    python -m bench.shards.compact_ab --shards 20000 --workers-a 1 --workers-b 2   # one tree, 1 against 2 workers

Shard presets (`--preset`; `--groups-per-shard`, `--group-size`, `--seq-len` override them):
- tiny (default, issue 34's bench): 10 groups of 4 x 64 tokens, ~35 kB a shard (bench.shards.scale);
- rl: 8 groups of 8 x 1024 tokens, ~640 kB (the RL loop's chunk of 8 problems, factory/train/rl_plan.py, with
  bench.serve's groups of 8 x 1024 tokens);
- datagen: 100 groups of 16 x 320 tokens, ~4.9 MB (factory/datagen/config.py's chunk of 100 items, the envs'
  default group_size 16 and max_tokens 256 after a 64-token prompt).
Shards under 1 MB are page-merged, larger ones have their row groups copied (store_compact.COPY_MIN_SHARD_BYTES).

Rounds alternate the order (A,B then B,A). Viewer: a new `RunIndex` refreshed with the viewer's 0.5 s budget
and the first 50 rows read (as bench.shards.scale), plus the CPU seconds of reading the run's log (the part that
does not depend on the budget) and how many groups were indexed within the budget.
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

_VIEWER = """
import json, sys, time
begin = time.perf_counter()
from factory.store import ShardStore
from factory.viewer.index import RunIndex
imported = time.perf_counter()
cpu = time.process_time()
index = RunIndex(ShardStore(sys.argv[1]), "gen")
index._read_log()
log_cpu = time.process_time() - cpu
index.refresh(budget_s=0.5)
frame = index.frame
rows = index.read_rows(frame.head(50), ["group_id", "item_key"])
print(json.dumps({"page_s": time.perf_counter() - imported, "log_cpu_s": log_cpu, "indexed": frame.height,
                  "rows": len(rows)}))
"""

_COMPACT = """
import json, os, sys
from factory.store import ShardStore
from factory.store_compact import compact_run
before = os.times()
workers = {"workers": int(sys.argv[2])} if len(sys.argv) > 2 and sys.argv[2] else {}  # older trees: no such option
report = compact_run(ShardStore(sys.argv[1]), "gen", target_bytes=128 << 20, flush=True, **workers)
after = os.times()
cpu = after.user - before.user + after.system - before.system
children = after.children_user - before.children_user + after.children_system - before.children_system
print(json.dumps({"mb_per_s": report.mb_per_s, "seconds": report.seconds, "files": len(report.files),
                  "mb": report.bytes_in / 1e6, "cpu_s": cpu + children, "workers_cpu_s": children}))
"""


def _run(tree: str, script: str, root: Path, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", script, str(root), *args], env=env, check=True, capture_output=True,
                         text=True, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


PRESETS = {"tiny": (10, 4, 64), "rl": (8, 8, 1024), "datagen": (100, 16, 320)}
"""(groups per shard, sequences per group, tokens per sequence)."""


def evict(directory: Path) -> int:
    """Drop the page cache of every file in `directory` (written back first by `sync`): the members of a real
    compaction are old files, and at 1M shards (35 GB) they no longer fit this machine's 23 GB of memory."""
    count = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            count += 1
    return count


def trial(tree: str, root: Path, shards: int, shape: tuple[int, int, int] = PRESETS["tiny"], cold: bool = False,
          workers: int | None = None) -> dict:
    from bench.shards.scale import RUN
    from factory.store import ShardStore
    from factory.synthetic_store import build_store

    shutil.rmtree(root, ignore_errors=True)
    groups, size, tokens = shape
    build_store(root, RUN, shards, groups_per_shard=groups, group_size=size, seq_len=tokens, env="bench")
    os.sync()
    load = os.getloadavg()[0]
    before = _run(tree, _VIEWER, root)
    if cold:
        evict(ShardStore(root).shards_dir(RUN))
    compacted = _run(tree, _COMPACT, root, "" if workers is None else str(workers))
    after = _run(tree, _VIEWER, root)
    shutil.rmtree(root, ignore_errors=True)
    return {"load": load, "load_end": os.getloadavg()[0], "before": before, "compact": compacted, "after": after,
            "at": time.strftime("%H:%M:%S", time.gmtime())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=20000)
    parser.add_argument("--a", default=".", help="code tree A (e.g. `git archive` of the commit before)")
    parser.add_argument("--b", default=".", help="code tree B")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=None, help="scratch directory (the store is removed after each trial)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="shard shape (see above)")
    parser.add_argument("--groups-per-shard", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=None, help="sequences per group")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--cold", action="store_true",
                        help="drop the members' page cache before compacting (as at 1M shards, which outgrow memory)")
    parser.add_argument("--workers-a", type=int, default=None,
                        help="compact_run(workers=) for tree A (default: not passed, the tree's own default)")
    parser.add_argument("--workers-b", type=int, default=None, help="the same for tree B")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shards, args.rounds = 300, 1
    shape = tuple(given if given is not None else default for given, default in
                  zip((args.groups_per_shard, args.group_size, args.seq_len), PRESETS[args.preset]))
    print(f"# {args.shards} shards of {shape[0]} groups of {shape[1]} x {shape[2]} tokens"
          + (", members evicted from the page cache before compacting" if args.cold else ""))
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="compact-ab-"))
    root = scratch / f"store-{args.shards}"
    results: dict[str, list[dict]] = {"A": [], "B": []}
    print("| trial | at (UTC) | load | compaction MB/s | compaction CPU s (of it workers') | viewer page s before / after | "
          "log CPU s before / after | groups indexed in budget before / after |")
    print("|---|---|---|---:|---:|---|---|---|")
    for round_ in range(args.rounds):
        order = ((("A", args.a, args.workers_a), ("B", args.b, args.workers_b)) if round_ % 2 == 0
                 else (("B", args.b, args.workers_b), ("A", args.a, args.workers_a)))
        for label, tree, workers in order:
            r = trial(tree, root, args.shards, shape, args.cold, workers)
            results[label].append(r)
            b, c, a = r["before"], r["compact"], r["after"]
            print(f"| {label}{round_ + 1} | {r['at']} | {r['load']:.2f} -> {r['load_end']:.2f} | {c['mb_per_s']:.1f} | "
                  f"{c['cpu_s']:.2f} ({c.get('workers_cpu_s', 0):.2f}) | {b['page_s']:.2f} / {a['page_s']:.2f} | {b['log_cpu_s']:.3f} / {a['log_cpu_s']:.3f} | "
                  f"{b['indexed']:,} / {a['indexed']:,} |", flush=True)
    for label in ("A", "B"):
        runs = results[label]
        print(f"# {label}: median compaction {statistics.median(r['compact']['mb_per_s'] for r in runs):.1f} MB/s "
              f"({runs[0]['compact']['mb']:.0f} MB, {args.shards} shards of {runs[0]['compact']['mb'] * 1e3 / args.shards:.0f} kB), viewer page after "
              f"{statistics.median(r['after']['page_s'] for r in runs):.2f} s, log CPU after "
              f"{statistics.median(r['after']['log_cpu_s'] for r in runs):.3f} s")
    if not args.dir:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
