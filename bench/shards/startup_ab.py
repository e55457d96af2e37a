"""run-api fresh start-up on one compacted store, two code trees interleaved (A, B, A, B ...): issue 34's
one-transaction-per-scan change measured as a ratio on a noisy machine.

    python -m bench.shards.startup_ab --shards 3000 --a /tmp/old-tree --b . --rounds 3
    python -m bench.shards.startup_ab --smoke          # 200 shards, this tree against itself, 1 round
    python -m bench.shards.startup_ab --shards 100000 --a /tmp/old-tree --b . --rounds 2 --restart
    python -m bench.shards.startup_ab --shards 10000 --no-compact --a /tmp/old-tree --b . --restart --digest

The store is built and compacted once with this tree's bench.shards.scale; every start-up runs in a fresh
process with PYTHONPATH set to the tree under test and an empty served state (every shard gets indexed).
The run's manifest (a cache of the parsed log, whose format a tree may change) is saved by each tree once, from
the log, and put in place before each of that tree's start-ups: each tree starts from its own checkpoint.
`--restart` also measures, after each fresh start-up, a restart from a served state in which every shard is
indexed and 2,000 groups are taken (`--taken N`: N; rows 0..9 of every 7th shard from the first on, as many as
it takes) (made once by each tree, copied for each of its start-ups). `--no-compact` measures the store as
built (every shard its own file); `--digest` checks that both trees queue the same groups in the same order.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

def queue_digest(queue) -> str:
    """sha256 of every lane's queued groups in order: (arrival number, source, row, size, version) as int64, lane
    by lane in lane order with its key; the same for blocks or entries (a tree may keep them either way)."""
    import hashlib

    import numpy as np

    digest = hashlib.sha256()
    for lane in sorted(queue._lanes):
        digest.update(repr(queue.lane_key_of[lane]).encode())
        parts = []
        for item in queue._lanes[lane]:
            if hasattr(item, "lo"):  # a block: rows lo..hi of its arrays
                parts.append(np.stack([np.asarray(a[item.lo:item.hi], dtype=np.int64) for a in
                                       (item.seqs, item.sources, item.rows, item.sizes, item.versions)], axis=1))
            elif item.state == 0:  # QUEUED
                parts.append(np.array([[item.seq, item.source, item.row, item.size, item.version]], dtype=np.int64))
        if parts:
            digest.update(np.ascontiguousarray(np.concatenate(parts)).tobytes())
    return digest.hexdigest()


_STARTUP = """
import asyncio, json, resource, sys, time
from factory.serve.config import ServeConfig
from factory.serve.service import BatchService
%s

async def main():
    begin = time.perf_counter()
    service = BatchService(ServeConfig(store_root=sys.argv[1], follow_runs=["gen"], follow_interval_s=3600,
                                       state_path=sys.argv[2], batch_metadata=False))
    await service.start()
    took = time.perf_counter() - begin
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime  # the process's CPU (imports included): a ratio that a loaded machine blurs less
    queued = service.queue.groups
    rss = usage.ru_maxrss / 1024
    digest = queue_digest(service.queue) if "--digest" in sys.argv else ""
    await service.stop()
    print(json.dumps({"startup_s": took, "cpu_s": cpu, "queued": queued, "peak_rss_mb": rss, "digest": digest}))

asyncio.run(main())
"""


_MANIFEST = """
import sys
from pathlib import Path
from factory.store import ShardStore, save_manifest
store = ShardStore(sys.argv[1])
store.manifest_path("gen").unlink(missing_ok=True)
assert save_manifest(store.manifest_path("gen"), store._read_log("gen"))
"""


def save_manifest_with(tree: str, root: Path, keep: Path) -> None:
    """The run's manifest as `tree` saves it from the whole log, kept at `keep`."""
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", _MANIFEST, str(root)], env=env, check=True, cwd=tree)
    shutil.copy(root / "gen" / "manifest.arrow", keep)


def startup(tree: str, root: Path, state: Path, digest: bool = False) -> dict:
    """One start-up of `tree` in its own process; `digest`: with the `queue_digest` of what it queued (the
    function's source goes with the script: tree A need not have it)."""
    import inspect

    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), OMP_NUM_THREADS="1")
    script = _STARTUP % inspect.getsource(queue_digest)
    out = subprocess.run([sys.executable, "-c", script, str(root), str(state)] + (["--digest"] if digest else []),
                         env=env, check=True, capture_output=True, text=True, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=3000)
    parser.add_argument("--a", default=".", help="code tree A (e.g. an export of the commit before)")
    parser.add_argument("--b", default=".", help="code tree B")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-compact", action="store_true")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--restart", action="store_true", help="also time restarts from an indexed served state")
    parser.add_argument("--taken", type=int, default=2000, help="groups taken in the restart's served state")
    parser.add_argument("--digest", action="store_true",
                        help="compare a hash of every lane's queue (round 0) between A and B; exit 1 if they differ")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shards, args.rounds = 200, 1
    from bench.shards.scale import build_store, compact

    scratch = Path(args.dir or tempfile.mkdtemp(prefix="startup-ab-"))
    root = scratch / f"store-{args.shards}"
    if not root.exists():
        built = build_store(root, args.shards)
        print(f"# built {args.shards} shards in {built['seconds']:.0f} s", flush=True)
        if not args.no_compact:
            print(f"# compacted: {compact(str(root), 128)}", flush=True)
    def remove(state: Path) -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{state}{suffix}").unlink(missing_ok=True)

    manifests = {label: scratch / f"manifest-{label}.arrow" for label in ("A", "B")}
    for label, tree in (("A", args.a), ("B", args.b)):
        save_manifest_with(tree, root, manifests[label])

    def use_manifest(label: str) -> None:
        shutil.copy(manifests[label], root / "gen" / "manifest.arrow")

    indexed = {label: scratch / f"state-indexed-{label}.db" for label in ("A", "B")}
    if args.restart:
        for label, tree in (("A", args.a), ("B", args.b)):
            remove(indexed[label])
            use_manifest(label)
            startup(tree, root, indexed[label])
            db = sqlite3.connect(indexed[label])
            with db:  # groups taken, as a served life leaves them (one in 7 shards' rows)
                db.executemany("INSERT OR REPLACE INTO taken (source, row, step, pos, epoch) VALUES (?, ?, ?, ?, 0)",
                               ((1 + i // 10 * 7, i % 10, i // 256, i % 256) for i in range(args.taken)))
            db.close()
    times: dict[str, list[float]] = {"A": [], "B": [], "A restart": [], "B restart": [], "A cpu": [], "B cpu": []}
    digests: dict[str, list[str | None]] = {}
    for round_ in range(args.rounds):
        for label, tree in (("A", args.a), ("B", args.b)):
            state = scratch / f"state-{label}-{round_}.db"
            use_manifest(label)
            check = args.digest and round_ == 0
            result = startup(tree, root, state, check)
            remove(state)
            digests.setdefault("fresh", []).append(result.get("digest"))
            times[label].append(result["startup_s"])
            times[f"{label} cpu"].append(result.get("cpu_s", float("nan")))
            line = (f"round {round_} {label}: start-up {result['startup_s']:.2f} s ({result.get('cpu_s', float('nan')):.2f} s "
                    f"CPU since the process began), {result['queued']} groups queued, "
                    f"peak RSS {result['peak_rss_mb']:.0f} MiB")
            if args.restart:
                shutil.copy(indexed[label], state)
                again = startup(tree, root, state, check)
                remove(state)
                digests.setdefault("restart", []).append(again.get("digest"))
                times[f"{label} restart"].append(again["startup_s"])
                line += f"; restart {again['startup_s']:.2f} s, {again['queued']} queued, peak RSS {again['peak_rss_mb']:.0f} MiB"
            print(f"{line}; load {os.getloadavg()[0]:.2f}", flush=True)
    for label in ("A", "B"):
        remove(indexed[label])
        manifests[label].unlink(missing_ok=True)
    if args.digest:  # round 0's A and B: the same groups queued in the same order, lane by lane
        for kind, (a, b) in ((kind, values[:2]) for kind, values in digests.items()):
            print(f"queue digest {kind}: A {a[:16]} B {b[:16]}: {'same' if a == b else 'DIFFERENT'}", flush=True)
            if a != b:
                raise SystemExit(f"A and B queued different groups at the {kind} start-up")
    a, b = statistics.median(times["A cpu"]), statistics.median(times["B cpu"])
    print(f"median CPU of a fresh start-up's process A {a:.2f} s, B {b:.2f} s, A/B {a / b:.2f}x")
    for kind in ("", " restart") if args.restart else ("",):
        a, b = statistics.median(times["A" + kind]), statistics.median(times["B" + kind])
        print(f"median{kind or ' start-up'} A {a:.2f} s, B {b:.2f} s, A/B {a / b:.2f}x; pairs A/B: "
              + ", ".join(f"{x / y:.2f}" for x, y in zip(times["A" + kind], times["B" + kind])))
    if not args.dir:  # a scratch store of its own (a --smoke run left one behind in /tmp each time)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
