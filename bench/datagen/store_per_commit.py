"""CPU of one shard commit as a run grows: a new store per commit (what `write_shard` did) vs the kept one.

    OMP_NUM_THREADS=1 python -m bench.datagen.store_per_commit --sizes 100,1000,3000 --commits 20

Chunks of one group are committed into one run; at each size, `--commits` more chunks are committed through a
new `ShardStore` each, then as many through `tasks.shards.store_at`'s kept store, and each side's CPU and wall
time per commit is printed. Each new store loads the run's manifest, parses the log after it and lists the shards
directory once before its commit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,3000", help="committed chunks at which to measure")
    parser.add_argument("--commits", type=int, default=20, help="commits per side at each size")
    args = parser.parse_args(argv)
    from factory.store import ShardStore
    from factory.synthetic import synthetic_groups
    from tasks.shards import store_at

    root = Path(tempfile.mkdtemp(prefix="bench-store-per-commit-"))
    group = list(synthetic_groups(1, group_size=8))
    kept, chunk = store_at(str(root)), 0
    print(f"load {os.getloadavg()[0]:.1f}")
    print("committed chunks  side                  CPU ms/commit  wall ms/commit")
    for size in (int(s) for s in args.sizes.split(",")):
        while chunk < size:
            kept.commit("r", "p", chunk, group)
            chunk += 1
        for side, store in (("new store per commit", lambda: ShardStore(root)), ("kept store", lambda: kept)):
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(args.commits):
                store().commit("r", "p", chunk, group)
                chunk += 1
            print(f"{size:16d}  {side:20s}  {1e3 * (time.process_time() - cpu) / args.commits:13.2f}"
                  f"  {1e3 * (time.perf_counter() - wall) / args.commits:14.2f}", flush=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
