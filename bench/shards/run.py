"""Shard store throughput and memory: write and read groups/s, MB/s and peak RSS.

    python -m bench.shards.run                      # 100k groups of 8 x 1024 tokens (~9 GB on disk)
    python -m bench.shards.run --groups 5000        # a quick look
    python -m bench.shards.run --smoke              # seconds, in-process (CI)

Each measurement runs in its own subprocess so peak RSS is its own. Side by
side in interleaved rounds (bench/harness.py; ratios to the bare pyarrow side
within each round): the store's commit (validate, convert, zstd, fsync, rename,
log) against a bare `pyarrow.parquet` write of the same batches, and the
store's readers against a bare `ParquetFile.iter_batches`; JSONL lines (what
Atropos's process mode writes) as a second reference on a smaller slice.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench import harness

POOL = 32  # distinct token payloads; groups cycle through them with their own ids


def _groups(count: int, group_size: int, seq_len: int) -> Iterator:
    """Groups cycling through a small pool of payloads; the pool is built before this returns."""
    from environments.groups import make_group_id
    from factory.synthetic import synthetic_group

    pool = [synthetic_group(i, group_size=group_size, seq_len=seq_len, env="bench") for i in range(POOL)]

    def generate() -> Iterator:
        for index in range(count):
            key = f"item-{index}"
            yield pool[index % POOL].model_copy(update={"item_key": key, "group_id": make_group_id("bench", key, 0, 0)})

    return generate()


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def store_write(root: str, groups: int, group_size: int, seq_len: int, chunk: int) -> dict:
    from factory.store import ShardStore

    store = ShardStore(root)
    store.committed("bench")  # imports and first-touch out of the timing
    source = _groups(groups, group_size, seq_len)
    start = time.perf_counter()
    for index in range(0, groups, chunk):
        store.commit("bench", "w0", index // chunk, (next(source) for _ in range(min(chunk, groups - index))))
    return {"seconds": time.perf_counter() - start, "bytes": _dir_bytes(Path(root)), "rss": _peak_rss_mib()}


def plain_parquet_write(root: str, groups: int, group_size: int, seq_len: int, chunk: int) -> dict:
    import pyarrow.parquet as pq

    from factory.schema import GROUP_SCHEMA, groups_to_record_batch
    from factory.store import ShardStore  # noqa: F401  (same imports as the store side)

    Path(root).mkdir(parents=True, exist_ok=True)
    source = _groups(groups, group_size, seq_len)
    start = time.perf_counter()
    for index in range(0, groups, chunk):
        with pq.ParquetWriter(f"{root}/{index}.parquet", GROUP_SCHEMA, compression="zstd") as writer:
            remaining = min(chunk, groups - index)
            while remaining:
                take = min(64, remaining)
                writer.write_batch(groups_to_record_batch([next(source) for _ in range(take)]), row_group_size=256)
                remaining -= take
    return {"seconds": time.perf_counter() - start, "bytes": _dir_bytes(Path(root)), "rss": _peak_rss_mib()}


def jsonl_write(root: str, groups: int, group_size: int, seq_len: int, chunk: int) -> dict:
    Path(root).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(f"{root}/groups.jsonl", "w") as out:
        for group in _groups(groups, group_size, seq_len):
            out.write(json.dumps(group.wire_dict()) + "\n")
    return {"seconds": time.perf_counter() - start, "bytes": _dir_bytes(Path(root)), "rss": _peak_rss_mib()}


def store_read_batches(root: str, *_args) -> dict:
    from factory.store import ShardStore

    ShardStore(root).committed("bench")
    start = time.perf_counter()
    rows = sum(batch.num_rows for batch in ShardStore(root).iter_batches("bench"))
    return {"seconds": time.perf_counter() - start, "rows": rows, "rss": _peak_rss_mib()}


def plain_read_batches(root: str, *_args) -> dict:
    import pyarrow.parquet as pq

    from factory.store import ShardStore  # noqa: F401  (same imports as the store side)

    start = time.perf_counter()
    rows = 0
    for path in sorted(Path(root).glob("*.parquet")):
        rows += sum(b.num_rows for b in pq.ParquetFile(path).iter_batches(batch_size=64))
    return {"seconds": time.perf_counter() - start, "rows": rows, "rss": _peak_rss_mib()}


def store_read_groups(root: str, limit: int, *_args) -> dict:
    from factory.store import ShardStore

    ShardStore(root).committed("bench")
    start = time.perf_counter()
    rows = 0
    for _ in ShardStore(root).iter_groups("bench"):
        rows += 1
        if rows >= limit:
            break
    return {"seconds": time.perf_counter() - start, "rows": rows, "rss": _peak_rss_mib()}


def _isolated(function, *args) -> dict:
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(function, args)


def _write_side(function, root: Path, count: int, shape: tuple, raw_mb_per_group: float, isolate: bool):
    """A harness side: write `count` groups into a fresh `root` (in its own process when `isolate`)."""
    def run() -> dict:
        shutil.rmtree(root, ignore_errors=True)
        result = (_isolated if isolate else lambda f, *a: f(*a))(function, str(root), count, *shape)
        return {"groups/s": count / result["seconds"], "raw MB/s": count * raw_mb_per_group / result["seconds"],
                "peak RSS MiB": result["rss"], "kB/group on disk": result["bytes"] / count / 1e3}
    return run


def _read_side(function, root: Path, extra: tuple, raw_mb_per_group: float, isolate: bool):
    def run() -> dict:
        result = (_isolated if isolate else lambda f, *a: f(*a))(function, str(root), *extra)
        return {"groups/s": result["rows"] / result["seconds"],
                "raw MB/s": result["rows"] * raw_mb_per_group / result["seconds"], "peak RSS MiB": result["rss"]}
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=100_000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=1000, help="groups per shard")
    parser.add_argument("--jsonl-groups", type=int, default=10_000, help="groups for the JSONL reference")
    parser.add_argument("--read-groups", type=int, default=10_000, help="groups rebuilt as ScoredGroup objects")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    harness.add_bench_args(parser)
    args = parser.parse_args(argv)
    if args.smoke:  # in-process: the point is that every path still runs, not its peak RSS
        args.groups, args.seq_len, args.chunk, args.jsonl_groups, args.read_groups = 200, 128, 50, 100, 100
    pairs, json_out = harness.pairs_from(args), harness.json_path("shards", args)
    isolate = not args.smoke

    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench-shards-"))
    shape = (args.group_size, args.seq_len, args.chunk)
    raw_mb_per_group = args.group_size * args.seq_len * (4 + 4 + 8) / 1e6  # tokens, masks, logprobs
    store, plain, jsonl = scratch / "store", scratch / "plain", scratch / "jsonl"
    try:
        writes = harness.compare("shards", [
            harness.Side("write: bare pyarrow", _write_side(plain_parquet_write, plain, args.groups, shape,
                                                            raw_mb_per_group, isolate)),
            harness.Side("write: store.commit", _write_side(store_write, store, args.groups, shape,
                                                            raw_mb_per_group, isolate)),
            harness.Side(f"write: JSONL (Atropos process), {args.jsonl_groups} groups",
                         _write_side(jsonl_write, jsonl, args.jsonl_groups, shape, raw_mb_per_group, isolate)),
        ], pairs=pairs, json_out=json_out, label="write")
        shutil.rmtree(jsonl, ignore_errors=True)
        reads = harness.compare("shards", [
            harness.Side("read: bare iter_batches", _read_side(plain_read_batches, plain, (), raw_mb_per_group,
                                                               isolate)),
            harness.Side("read: store.iter_batches", _read_side(store_read_batches, store, (), raw_mb_per_group,
                                                                isolate)),
            harness.Side(f"read: store.iter_groups, {args.read_groups} groups",
                         _read_side(store_read_groups, store, (args.read_groups,), raw_mb_per_group, isolate)),
        ], pairs=pairs, json_out=json_out, label="read")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    size = (f"{args.groups} groups of {args.group_size} x {args.seq_len} tokens ({raw_mb_per_group:.3f} MB raw per "
            f"group), {args.chunk} groups per shard")
    harness.print_comparison(writes, title=f"shard store writes, {size}")
    harness.print_comparison(reads, title=f"shard store reads, {size}", json_out=json_out)


if __name__ == "__main__":
    main()
