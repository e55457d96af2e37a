"""Shard store at scale (issue 34): run-api start-up, follow latency, drain rate, export and viewer first page on
stores of many small shards, before and after compaction.

    python -m bench.shards.scale --shards 10000 100000       # each size in turn (~36 kB shards: 10 groups of 4 x 64)
    python -m bench.shards.scale --smoke                      # 300 shards, seconds
    python -m bench.shards.scale --compare                    # compaction MB/s: gathering pages, copying row groups, decoding
    python -m bench.shards.scale --compare --smoke            # the same on a few shards, seconds
    python -m bench.shards.scale --shards 2000 --compact-by pages   # serving etc. after one way of compacting

A store is built synthetically (factory/synthetic_store.py: each shard's file is byte for byte what `ShardStore.commit`
writes for its groups, made by patching a template's group ids, item keys, CRCs and statistics instead of encoding;
logged as `commit` logs it, minus the per-shard fsync; ~0.3-0.6 ms per shard, mostly creating the file; the run's
manifest checkpointed at the end, as a live store's readers do); each measurement runs in its own process (a cold
start, as a restart is). `--build-workers 2` writes blocks of shards in two processes (no faster on this VM).
Measured per size, before and after `compact_run`:

- start-up (fresh): run-api following the run with an empty served state, until `start()` returns (every shard indexed);
- restart: again with the served state the fresh start left (what a restart after a crash or deploy costs);
- follow latency: a shard committed by another process until run-api has queued it (median of 5; follow interval 0.1 s);
- drain: /batch bodies of 256 sequences per second (first 200 batches);
- export: groups/s of the export's store source (`iter_store_groups`, metadata columns), first 200k groups, and
  the time to its first group (what it pays for the history before reading anything);
- viewer first page: a new `RunIndex` refreshed with the viewer's 0.5 s budget, then the first 50 rows read.

`--startup-limit-s N` kills a run-api life still starting after N s (+ 45 s for its follow and drain) and reports
"> N": before compaction, start-up reads every shard's index columns (~1 ms per shard), far too long at 1M shards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

RUN = "gen"
GROUPS_PER_SHARD = 10


def build_store(root: Path, shards: int, workers: int = 1) -> dict:
    """`shards` committed shards of GROUPS_PER_SHARD distinct groups each (4 x 64 tokens), logged as
    `ShardStore.commit` logs them (factory/synthetic_store.py: byte for byte its files, minus the per-shard fsync),
    and the run's manifest checkpointed as a live store's readers do."""
    from factory.synthetic_store import build_store as build

    return build(root, RUN, shards, workers=workers, groups_per_shard=GROUPS_PER_SHARD, group_size=4, seq_len=64, env="bench")


def _service_config(root: str, state: str):
    from factory.serve.config import ServeConfig

    return ServeConfig(store_root=root, follow_runs=[RUN], follow_interval_s=0.1, state_path=state, batch_metadata=False)


REGISTRATION = dict(wandb_group="g", wandb_project="p", batch_size=256, max_token_len=64, checkpoint_dir="ckpt",
                    save_checkpoint_interval=0, starting_step=0, num_steps=10**6)


def measure_serve(root: str, state: str, next_chunk: int, drain: bool, profile: bool = False) -> dict:
    """Start-up, follow latency and (optionally) drain rate of one run-api process life; `profile`: only the
    start-up, under cProfile (the top functions by cumulative time come back as text)."""
    from factory.serve.service import BatchService
    from factory.store import ShardStore
    from factory.synthetic import synthetic_groups

    async def scenario() -> dict:
        begin = time.perf_counter()
        profiler = None
        if profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        service = BatchService(_service_config(root, state))
        if profiler is not None:  # the scan runs in a worker thread: profile it there too
            import cProfile

            scan, scanned = service._scan, cProfile.Profile()

            def profiled_scan():
                return scanned.runcall(scan)

            service._scan = profiled_scan
        await service.start()
        startup = time.perf_counter() - begin
        result = {"startup_s": startup, "queued": service.queue.groups, "rss_mib": _rss()}
        if profiler is not None:
            import io
            import pstats

            profiler.disable()
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.add(scanned)
            stats.sort_stats("cumulative").print_stats(30)
            result["profile"] = text.getvalue()
            await service.stop()
            return result
        writer = ShardStore(root)
        latencies = []
        for index in range(5):
            chunk = next_chunk + index
            record = await asyncio.to_thread(
                writer.commit, RUN, "w1", chunk, synthetic_groups(GROUPS_PER_SHARD, start=10**8 + chunk * 100, group_size=4, seq_len=64, env="bench"))
            committed = time.perf_counter()
            while (RUN, record.shard) not in service._known:
                await asyncio.sleep(0.005)
            latencies.append(time.perf_counter() - committed)
        result["follow_latency_s"] = statistics.median(latencies)
        if drain:
            await service.register(REGISTRATION)
            begin, batches = time.perf_counter(), 0
            while batches < 200:
                body = await service.next_batch(False)
                if not body.keys:  # no batch (the queue is drained)
                    break
                batches += 1
            result["drain_batches_per_s"] = batches / (time.perf_counter() - begin)
            result["drain_batches"] = batches
        await service.stop()
        return result

    return asyncio.run(scenario())


def measure_export(root: str, limit: int = 200_000) -> dict:
    from factory.export.config import SourceConfig
    from factory.export.source import iter_store_groups

    begin, rows, first = time.perf_counter(), 0, None
    for _ in iter_store_groups(SourceConfig(store=root, runs=[RUN]), need_tokens=False):
        rows += 1
        if first is None:
            first = time.perf_counter() - begin
        if rows >= limit:
            break
    seconds = time.perf_counter() - begin
    return {"export_groups": rows, "export_s": seconds, "export_groups_per_s": rows / seconds, "export_first_s": first}


def measure_viewer(root: str) -> dict:
    from factory.store import ShardStore
    from factory.viewer.index import RunIndex

    begin = time.perf_counter()
    index = RunIndex(ShardStore(root), RUN)
    index.refresh(budget_s=0.5)
    frame = index.frame
    frame = frame() if callable(frame) else frame
    rows = index.read_rows(frame.head(50), ["group_id", "item_key"])
    return {"viewer_first_page_s": time.perf_counter() - begin, "viewer_rows": len(rows), "viewer_pending": index.pending,
            "viewer_indexed_groups": frame.height}


def compact(root: str, target_mb: float, method: str | None = None) -> dict:
    from factory.store import ShardStore
    from factory.store_compact import compact_run

    report = compact_run(ShardStore(root), RUN, target_bytes=int(target_mb * (1 << 20)), flush=True, method=method)
    return {"compact_s": report.seconds, "compact_mb_per_s": report.mb_per_s, "compact_files": len(report.files),
            "copied_files": report.copied, "paged_files": report.paged, "decoded": report.decoded[:1],
            "compact_shards": report.shards, "bytes_in": report.bytes_in, "bytes_out": report.bytes_out}


def compaction_throughput(root: str, groups: int, chunk: int, target_mb: float) -> dict:
    """MB/s of shards merged, on shards of `chunk` groups of 8 x 1024 tokens (the shape of bench/shards/run.py)."""
    from bench.shards.run import store_write
    from factory.store import ShardStore
    from factory.store_compact import compact_run

    written = store_write(root, groups, 8, 1024, chunk)
    report = compact_run(ShardStore(root), "bench", target_bytes=int(target_mb * (1 << 20)), flush=True)
    return {"groups": groups, "shards": report.shards, "mb_in": report.bytes_in / 1e6, "files": len(report.files),
            "compact_s": report.seconds, "compact_mb_per_s": report.mb_per_s, "write_mb_per_s": written["bytes"] / 1e6 / written["seconds"]}


MODES = {"pages": "pages", "copy": "row_groups", "decode": "decode"}
"""--compare's trials: bench name -> compact_run method."""


def compaction_compare(scratch: str, small_shards: int, large_groups: int, large_chunk: int, pairs: int,
                       target_mb: float) -> list[dict]:
    """Compaction MB/s by gathering pages, by copying row groups and by decoding, on the same shards, interleaved
    (each round in another order), each trial on a fresh copy of one pristine store: small shards (`build_store`'s
    ~36 kB, 10 groups of 4 x 64 tokens) and large ones (`large_chunk` groups of 8 x 1024 tokens each)."""
    from bench.shards.run import store_write
    from factory.store import ShardStore
    from factory.store_compact import compact_run

    rows = []
    for size in ("small", "large"):
        pristine = Path(scratch) / f"pristine-{size}"
        shutil.rmtree(pristine, ignore_errors=True)
        if size == "small":
            build_store(pristine, small_shards)
            run = RUN
        else:
            store_write(str(pristine), large_groups, 8, 1024, large_chunk)
            run = "bench"
        records = list(ShardStore(pristine).committed(run).values())  # and checkpoints the manifest, as a live store has
        mb = sum(r.bytes for r in records) / 1e6
        trials: dict[str, list[float]] = {mode: [] for mode in MODES}
        orders = [list(MODES), list(reversed(MODES))]
        for pair in range(pairs):
            for mode in orders[pair % 2]:
                work = Path(scratch) / f"work-{size}"
                shutil.rmtree(work, ignore_errors=True)
                shutil.copytree(pristine, work)
                report = compact_run(ShardStore(work), run, target_bytes=int(target_mb * (1 << 20)), flush=True,
                                     method=MODES[mode])
                done = {"pages": report.paged, "copy": report.copied, "decode": len(report.decoded)}[mode]
                assert report.shards == len(records) and done == len(report.files), report
                trials[mode].append(report.mb_per_s)
                shutil.rmtree(work, ignore_errors=True)
        row = {"size": size, "shards": len(records), "mb": mb, "shard_kb": mb * 1e3 / len(records),
               **{f"{mode}_mb_per_s": trials[mode] for mode in MODES}}
        if size == "small":
            row.update(_per_file_costs(pristine, run, records))
        shutil.rmtree(pristine, ignore_errors=True)
        rows.append(row)
    return rows


def _per_file_costs(root: Path, run: str, records: list) -> dict:
    """Microseconds per member shard of the no-decode paths' parts: open + read, sha256 of the member, the row-group
    copy's footer parse and rewrite (`ParquetConcat.add`), the page merge's footer work and gathering (`PageMerge`,
    data in memory, output discarded) and the sha256 of what it writes."""
    import hashlib
    import io

    from factory.parquet_concat import ParquetConcat
    from factory.parquet_pages import PageMerge
    from factory.store import ShardStore

    shards = ShardStore(root).shards_dir(run)
    begin = time.perf_counter()
    blobs = []
    for record in records:
        fd = os.open(shards / record.shard, os.O_RDONLY)
        try:
            blobs.append(os.read(fd, record.bytes + 1))
        finally:
            os.close(fd)
    read_us = (time.perf_counter() - begin) / len(records) * 1e6
    begin = time.perf_counter()
    for data in blobs:
        hashlib.sha256(data).hexdigest()
    hash_us = (time.perf_counter() - begin) / len(records) * 1e6
    concat = ParquetConcat(io.BytesIO())
    begin = time.perf_counter()
    for data in blobs:
        concat.add(data)
    concat.finish()
    footer_us = (time.perf_counter() - begin) / len(records) * 1e6
    pieces: list = []
    merge = PageMerge(pieces.append)
    begin = time.perf_counter()
    for data in blobs:
        merge.add(data)
    merge.finish()
    pages_us = (time.perf_counter() - begin) / len(records) * 1e6
    digest = hashlib.sha256()
    begin = time.perf_counter()
    for piece in pieces:
        digest.update(piece)
    out_hash_us = (time.perf_counter() - begin) / len(records) * 1e6
    footer = int.from_bytes(blobs[0][-8:-4], "little")
    return {"read_us_per_file": read_us, "hash_us_per_file": hash_us, "footer_us_per_file": footer_us,
            "pages_us_per_file": pages_us, "out_hash_us_per_file": out_hash_us, "footer_bytes_per_shard": footer}


def _rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _isolated(function, *args, timeout: float | None = None) -> dict:
    """`function(*args)` in a fresh process; past `timeout` seconds the process is killed (multiprocessing.TimeoutError)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply_async(function, args).get(timeout)


def _isolated_parent(function, *args) -> dict:
    """`function(*args)` in a fresh process that may start processes of its own (a compaction's workers): a
    multiprocessing pool's worker is daemonic and may not (the compaction would merge in one process)."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def run_size(scratch: Path, shards: int, target_mb: float, isolate: bool, method: str | None = None,
             build_workers: int = 1, profile: tuple[str, ...] = (), startup_limit_s: float | None = None) -> list[dict]:
    call = _isolated if isolate else (lambda f, *a, timeout=None: f(*a))
    root = scratch / f"store-{shards}"
    shutil.rmtree(root, ignore_errors=True)
    built = call(build_store, root, shards, build_workers)
    print(f"# built {shards} shards ({built['bytes'] / 1e6:.0f} MB) in {built['seconds']:.1f} s "
          f"({built['write_seconds'] / shards * 1e3:.2f} ms per shard written, then the manifest), {_now()}", flush=True)

    def serve(state: str, chunk: int, drain: bool) -> dict | None:
        """One run-api life; None where start-up did not finish within `startup_limit_s` (the process is killed)."""
        limit = None if startup_limit_s is None else startup_limit_s + 45  # + follow latency, drain and spawning
        try:
            return call(measure_serve, str(root), state, chunk, drain, timeout=limit)
        except multiprocessing.TimeoutError:
            print(f"# run-api life killed after {limit:.0f} s (start-up limit {startup_limit_s:.0f} s), {_now()}", flush=True)
            return None

    rows = []
    next_chunk = 0
    state = str(scratch / f"state-{shards}.sqlite")
    Path(state).unlink(missing_ok=True)
    for phase in ("before", "after"):
        if phase == "after":
            done = (_isolated_parent if isolate else call)(compact, str(root), target_mb, method)
            print(f"# compaction: {json.dumps(done)}, {_now()}", flush=True)
        row = {"shards": shards, "phase": phase, "mb": built["bytes"] / 1e6,
               "build_ms_per_shard": built["write_seconds"] / shards * 1e3, "startup_limit_s": startup_limit_s}
        if phase == "after":
            row.update(compact_s=done["compact_s"], compact_files=done["compact_files"],
                       compact_mb_per_s=done["compact_mb_per_s"])
        fresh_state = state if phase == "before" else str(scratch / f"state-{shards}-fresh.sqlite")
        if phase == "after":
            Path(fresh_state).unlink(missing_ok=True)
        fresh = serve(fresh_state, next_chunk, True)
        next_chunk += 5
        row.update(startup_fresh_s=fresh and fresh["startup_s"], follow_latency_s=fresh and fresh["follow_latency_s"],
                   drain_batches_per_s=fresh and fresh["drain_batches_per_s"], idle_rss_mib=fresh and fresh["rss_mib"])
        if phase == "after":
            Path(fresh_state).unlink(missing_ok=True)
        # a restart with the served state of the "before" life (unless that life was cut short: then skipped before
        # compaction, and after it a start from the state it left)
        again = serve(state, next_chunk, False) if fresh is not None or phase == "after" else None
        next_chunk += 5
        row["restart_s"] = again and again["startup_s"]
        row.update(call(measure_export, str(root)))
        row.update(call(measure_viewer, str(root)))
        rows.append(row)
        print(json.dumps(row), f"# {_now()}", flush=True)
        if phase in profile:
            profiled_state = str(scratch / f"state-{shards}-profile.sqlite")
            Path(profiled_state).unlink(missing_ok=True)
            try:
                profiled = call(measure_serve, str(root), profiled_state, 0, False, True,
                                timeout=None if startup_limit_s is None else 2 * startup_limit_s + 45)
                print(f"# cProfile of a fresh start-up {phase} compaction ({profiled['startup_s']:.2f} s under the "
                      f"profiler):\n{profiled['profile']}", flush=True)
            except multiprocessing.TimeoutError:
                print(f"# cProfile of a fresh start-up {phase} compaction: killed after {2 * startup_limit_s + 45:.0f} s", flush=True)
            Path(profiled_state).unlink(missing_ok=True)
    shutil.rmtree(root, ignore_errors=True)
    Path(state).unlink(missing_ok=True)
    return rows


def _now() -> str:
    return f"{time.strftime('%H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()[0]:.2f}"


def _cell(value: float | None, spec: str, limit: float | None = None) -> str:
    if value is None:
        return f"> {limit:.0f} (killed)" if limit is not None else "-"
    return format(value, spec)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--target-mb", type=float, default=128)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="300 shards, in-process")
    parser.add_argument("--json-out", default=None, help="append one JSON line per size and phase")
    parser.add_argument("--throughput", type=int, nargs=2, metavar=("GROUPS", "CHUNK"), default=None,
                        help="only measure compaction MB/s on GROUPS groups of 8 x 1024 tokens, CHUNK groups per shard")
    parser.add_argument("--compare", action="store_true",
                        help="only compaction MB/s, gathering pages vs copying row groups vs decoding, interleaved, on small and large shards")
    parser.add_argument("--pairs", type=int, default=3, help="--compare: rounds of (pages, copy, decode) per shard size")
    parser.add_argument("--small-shards", type=int, default=3000, help="--compare: ~36 kB shards merged")
    parser.add_argument("--large", type=int, nargs=2, metavar=("GROUPS", "CHUNK"), default=[2000, 200],
                        help="--compare: GROUPS groups of 8 x 1024 tokens in shards of CHUNK groups (~15 MB at 200)")
    parser.add_argument("--profile", nargs="*", choices=["before", "after"], default=[],
                        help="also profile one fresh run-api start-up (cProfile) before and/or after compaction")
    parser.add_argument("--startup-limit-s", type=float, default=None,
                        help="kill a run-api life whose start-up has not finished after this many seconds (reported as '> N')")
    parser.add_argument("--build-workers", type=int, default=1, help="processes writing the synthetic store")
    parser.add_argument("--compact-by", choices=["auto", "pages", "copy", "decode"], default="auto",
                        help="how the shards are merged: compact_run's choice by shard size, or always one way")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shards = [300]
        args.small_shards, args.large, args.pairs = 100, [40, 20], 1
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench-shard-scale-"))
    if args.compare:
        try:
            rows = _isolated_parent(compaction_compare, str(scratch), args.small_shards, *args.large, args.pairs, args.target_mb)
        finally:
            if not args.dir:
                shutil.rmtree(scratch, ignore_errors=True)
        print("\n| shards | count | MB | kB/shard | pages MB/s (each) | copy MB/s (each) | decode MB/s (each) "
              "| pages / decode | copy / decode |")
        print("|---|---:|---:|---:|---|---|---|---:|---:|")
        for r in rows:
            median = {mode: statistics.median(r[f"{mode}_mb_per_s"]) for mode in MODES}
            cells = " | ".join(f"{median[mode]:.1f} ({', '.join(f'{v:.1f}' for v in r[f'{mode}_mb_per_s'])})" for mode in MODES)
            print(f"| {r['size']} | {r['shards']:,} | {r['mb']:.1f} | {r['shard_kb']:.1f} | {cells} | "
                  f"{median['pages'] / median['decode']:.1f}x | {median['copy'] / median['decode']:.1f}x |")
        small = rows[0]
        print(f"\nsmall shards, per file, in one process, data in memory: open + read {small['read_us_per_file']:.0f} us, "
              f"sha256 {small['hash_us_per_file']:.0f} us; page merge {small['pages_us_per_file']:.0f} us + sha256 of its "
              f"output {small['out_hash_us_per_file']:.0f} us; row-group copy's footer parse + rewrite "
              f"{small['footer_us_per_file']:.0f} us (footer {small['footer_bytes_per_shard']} bytes of "
              f"{small['shard_kb'] * 1e3:.0f})")
        if args.json_out:
            with open(args.json_out, "a") as out:
                for row in rows:
                    out.write(json.dumps(row) + "\n")
        return None
    if args.throughput:
        root = scratch / "throughput"
        shutil.rmtree(root, ignore_errors=True)
        try:
            result = _isolated_parent(compaction_throughput, str(root), *args.throughput, args.target_mb)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(json.dumps(result))
        return None
    rows = []
    try:
        for shards in args.shards:
            rows += run_size(scratch, shards, args.target_mb, isolate=not args.smoke,
                             method=None if args.compact_by == "auto" else MODES[args.compact_by],
                             build_workers=args.build_workers, profile=tuple(args.profile),
                             startup_limit_s=args.startup_limit_s)
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.json_out:
        with open(args.json_out, "a") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
    print("\n| shards | phase | start-up fresh s | restart s | follow latency s | drain batches/s | export groups/s "
          "| export first group s | viewer first page s | idle RSS MiB | built ms/shard, compacted s (files, MB/s) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        made = (f"{r['compact_s']:.0f} s ({r['compact_files']} files, {r['compact_mb_per_s']:.0f} MB/s)"
                if r["phase"] == "after" else f"{r['build_ms_per_shard']:.2f} ms ({r['mb']:,.0f} MB)")
        limit = r["startup_limit_s"]
        print(f"| {r['shards']:,} | {r['phase']} | {_cell(r['startup_fresh_s'], '.2f', limit)} | "
              f"{_cell(r['restart_s'], '.2f', limit if r['startup_fresh_s'] is not None or r['phase'] == 'after' else None)} | "
              f"{_cell(r['follow_latency_s'], '.3f')} | {_cell(r['drain_batches_per_s'], '.1f')} | "
              f"{r['export_groups_per_s']:,.0f} | {r['export_first_s']:.2f} | {r['viewer_first_page_s']:.2f} | {_cell(r['idle_rss_mib'], '.0f')} | {made} |")


if __name__ == "__main__":
    sys.exit(main())
