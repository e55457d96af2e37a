"""Shard commit cost per group count (the run-api's ingest commit and the datagen worker's shard write).

Each side (`--versus DIR`: another checkout, A; this checkout, B) runs in its own process, interleaved A,B per
round; each commits `--reps` shards of 1/4/8/16 groups (8 x 1024 random tokens each, as in issue 29) into a
fresh store under a temporary directory and reports the median wall ms and CPU ms per commit, and the CPU ms of
building the Arrow batch alone.

    python -m bench.serve.commit_bench --smoke
    OMP_NUM_THREADS=1 python -m bench.serve.commit_bench --versus /tmp/base --pairs 3 --reps 9
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COUNTS = (1, 4, 8, 16)


def _groups(count: int, seed: int, length: int, size: int) -> list:
    from environments.groups import ScoredGroup

    rng = random.Random(seed)
    groups = []
    for index in range(count):
        tokens = [[rng.randrange(150_000) for _ in range(length)] for _ in range(size)]
        masks = [[-100] * (length // 4) + sequence[length // 4:] for sequence in tokens]
        groups.append(ScoredGroup(tokens=tokens, masks=masks, scores=[rng.random() for _ in range(size)],
                                  env="bench", item_key=f"k{index}", run_id="bench", policy_version=0))
    return groups


def measure(reps: int, length: int, size: int) -> dict[str, dict[str, float]]:
    from factory.schema import groups_to_record_batch
    from factory.store import ShardStore

    data = {count: _groups(count, count, length, size) for count in COUNTS}
    result = {}
    with tempfile.TemporaryDirectory() as root:
        store = ShardStore(root)
        store.commit("warm", "p", 0, data[1])  # the first conversion's one-time cost is not a commit's
        chunk = 0
        for count in COUNTS:
            walls, cpus = [], []
            for _ in range(reps):
                cpu, wall = time.process_time(), time.perf_counter()
                store.commit("bench", "p", chunk, data[count])
                walls.append((time.perf_counter() - wall) * 1e3)
                cpus.append((time.process_time() - cpu) * 1e3)
                chunk += 1
            cpu = time.process_time()
            for _ in range(reps):
                groups_to_record_batch(data[count])
            build = (time.process_time() - cpu) * 1e3 / reps
            walls.sort(), cpus.sort()
            result[str(count)] = {"wall_ms": walls[reps // 2], "cpu_ms": cpus[reps // 2], "build_cpu_ms": build}
    return result


def _run_side(checkout: Path, reps: int, length: int, size: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    # The driver is this file, loaded by path, so both sides run the same one against their own factory/.
    code = ("import json, runpy; m = runpy.run_path(%r); print(json.dumps(m['measure'](%d, %d, %d)))"
            % (str(Path(__file__).resolve()), reps, length, size))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=checkout, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the bench side in {checkout} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versus", type=Path, help="another checkout to compare with (side A)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--reps", type=int, default=9, help="commits per group count per side and round")
    parser.add_argument("--length", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--size", type=int, default=8, help="sequences per group")
    parser.add_argument("--smoke", action="store_true", help="1 pair, 3 reps, 64-token sequences")
    args = parser.parse_args(argv)
    if args.smoke:
        args.pairs, args.reps, args.length = 1, 3, 64
    if args.versus is not None and not (args.versus / "factory" / "store.py").is_file():
        print(f"--versus {args.versus}: not a checkout of this project (no factory/store.py); pass one", file=sys.stderr)
        return 2
    here = Path(__file__).resolve().parents[2]
    sides = [("A", args.versus), ("B", here)] if args.versus else [("B", here)]
    rows = []
    for round_ in range(args.pairs):
        results = {name: _run_side(path, args.reps, args.length, args.size) for name, path in sides}
        for count in COUNTS:
            line = {"round": round_, "groups": count, **{f"{n}_{k}": round(v, 2) for n, r in results.items() for k, v in r[str(count)].items()}}
            if args.versus:
                line["A/B_cpu"] = round(line["A_cpu_ms"] / line["B_cpu_ms"], 2)
            rows.append(line)
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
