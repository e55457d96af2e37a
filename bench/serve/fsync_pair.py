"""A shard's two fsyncs (its file, its directory's new entry) one after the other vs issued together, then the
commit record's append and fsync, on the filesystem under `--dir` (default: a temporary directory under /tmp).

Each round writes `--reps` files of `--kb` KB per mode, interleaved by round; prints the median wall ms of the
shard's fsyncs and of the record's append per mode. What the store's commit does since issue 29 is `together`
(factory/store.py `_fsync_shard_and_dir`); `sequential` is what it did before.

    python -m bench.serve.fsync_pair --smoke
    python -m bench.serve.fsync_pair --rounds 8 --reps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from factory.commit_log import fsync_dir

MODES = ("sequential", "together")


def _one(directory: Path, index: int, data: bytes, mode: str, pool: ThreadPoolExecutor) -> tuple[float, float]:
    tmp = directory / f".shard-{index}.tmp"
    start = time.perf_counter()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if mode == "together":
            synced = pool.submit(fsync_dir, directory)
            os.fsync(fd)
            synced.result()
        else:
            os.fsync(fd)
            fsync_dir(directory)
    finally:
        os.close(fd)
    shard = time.perf_counter() - start
    log = os.open(directory / "commits.jsonl", os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(log, b"x" * 300 + b"\n")
        os.fsync(log)
    finally:
        os.close(log)
    os.replace(tmp, directory / f"shard-{index}")
    return shard, time.perf_counter() - start - shard


def measure(directory: Path, rounds: int, reps: int, kb: int) -> dict[str, dict[str, float]]:
    data = os.urandom(kb * 1000)
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    index = 0
    with ThreadPoolExecutor(max_workers=1) as pool:
        for _ in range(rounds):
            for mode in MODES:
                for _ in range(reps):
                    times[mode].append(_one(directory, index, data, mode, pool))
                    index += 1
    return {mode: {"shard_fsyncs_ms": 1000 * statistics.median(t[0] for t in values),
                   "record_ms": 1000 * statistics.median(t[1] for t in values)} for mode, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary directory under /tmp)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--reps", type=int, default=20, help="files per mode and round")
    parser.add_argument("--kb", type=int, default=320, help="KB per file (a 4-group shard of the bench's groups)")
    parser.add_argument("--smoke", action="store_true", help="1 round of 2 small files")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.reps, args.kb = 1, 2, 4
    with tempfile.TemporaryDirectory(prefix="fsync-pair-", dir=args.dir) as root:
        result = measure(Path(root), args.rounds, args.reps, args.kb)
    print(json.dumps({"load1": round(os.getloadavg()[0], 2), **result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
