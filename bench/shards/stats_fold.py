"""Chunk stats folding (issue 34): what the readers of a run's per-chunk stats pay before and after folding.

    python -m bench.shards.stats_fold --chunks 20000 --rounds 3
    python -m bench.shards.stats_fold --chunks 20000 --rounds 3 --baseline /work/main   # + A read by main's code
    python -m bench.shards.stats_fold --smoke          # 600 chunks, 1 round, seconds

One run of `--chunks` committed chunks of one producer is built twice under a scratch root: A keeps one stats file
per chunk (a run before folding), B is the same files folded every FOLD_CHUNKS chunks into segments
(factory/chunk_stats.py), as the datagen flow leaves them. The stats are what `ChunkCommitter.commit` writes for a
real chunk: InternBootcamp items (`--chunk-items`, default the datagen default of 100) through `group_chunk` with
scripted rollouts, the curriculum on (`--no-curriculum`: off, the datagen default; its files are ~5x smaller), eight
such chunks cycled with their chunk number, flow run id and timestamps set. Only the commit log is written for the
shards (`factory.synthetic_store.commit_line`; none of these readers opens a shard).

Timed, A then B then A ... (`--rounds` pairs; medians and B/A ratios per pair), each reader in a fresh process
(a viewer's or a flow's first look is a cold start of its process; the page cache is warm for all);
`--baseline TREE` adds A0 before each pair: run A read by another code tree (e.g. main, before folding existed):
- viewer first look: a new `RunIndex`'s `_refresh_stats` (glob, stat, read every new file), then `drops()`, then
  `drops()` three more times (a page's calls: where a garbage collection deferred by the first look would land);
- viewer second look: `_refresh_stats` again with nothing changed (what every page refresh pays);
- summarize: `factory.datagen.summary.summarize` of the producer (the end of every flow call);
- sampler start: `DynamicSampling(...)` restoring the run (with the curriculum replay when on; every flow start).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

RUN_A, RUN_B, PRODUCER = "before", "after", "intern-bootcamp"
FLOW_RUN_EVERY = 500
"""Chunks per flow run id (a worker's flow call)."""


def stats_templates(chunk_items: int, curriculum: bool, count: int = 8) -> list[dict]:
    """`count` stats dicts as `ChunkCommitter.commit` writes them for real InternBootcamp chunks."""
    from environments.base import Rollout
    from environments.bootcamp_tasks import parse_key
    from environments.intern_bootcamp import InternBootcampConfig, InternBootcampEnv
    from factory.curriculum import CurriculumSettings
    from factory.sampling import DynamicSampling, make_curriculum
    from factory.store import ShardStore
    from tasks.group import group_chunk

    pass_by_level = {1: 0.97, 2: 0.8, 3: 0.5, 4: 0.15, 5: 0.0}
    env = InternBootcampEnv(InternBootcampConfig(difficulties=[3], group_size=8))
    out = []
    with tempfile.TemporaryDirectory() as scratch:
        sampler = DynamicSampling(ShardStore(scratch), run_id="t", producer=PRODUCER, chunk_items=chunk_items,
                                  total_items=chunk_items * count,
                                  curriculum=make_curriculum(CurriculumSettings(enabled=curriculum), env,
                                                             start_level=3), solved=env.solved)
        for chunk in range(count):
            items = [env.get_item(i) for i in sampler.indices(chunk)]
            rollouts = []
            for item in items:
                _, level, _ = parse_key(item.key)
                rollouts.append([Rollout(item.key, "t", [1] * 200, [2] * 350, [-0.1] * 350, "stop", 0,
                                         score=1.0 if int(hashlib.sha256(f"{item.key}:{j}".encode()).hexdigest()[:8],
                                                          16) / 2**32 < pass_by_level[level] else -0.5)
                                 for j in range(8)])
            grouped = group_chunk("intern_bootcamp", items, rollouts, group_size=8, max_token_length=4096, run_id="t")
            grouped.generate_started_at, grouped.generate_s = 1.79e9 + chunk * 10.0, 9.5
            out.append({**grouped.stats(), "chunk": chunk, **sampler.chunk_stats(chunk, grouped),
                        "flow_run_id": "0c5c0b1e-6a8e-4c52-9a51-7c3c8f6f1a01"})
    return out


def build(root: Path, chunks: int, templates: list[dict]) -> dict:
    """Run A (per-chunk files) and run B (the same, folded), both with the same commit log."""
    from factory import chunk_stats
    from factory.store import ShardStore, save_manifest
    from factory.synthetic_store import commit_line

    begin = time.perf_counter()
    store = ShardStore(root)
    for run in (RUN_A, RUN_B):
        store.shards_dir(run).mkdir(parents=True)
        store.commit_log(run).write_bytes(b"".join(commit_line(run, PRODUCER, chunk, 90, b"x")
                                                   for chunk in range(chunks)))
        save_manifest(store.manifest_path(run), ShardStore(root)._read_log(run))
    run_a = store.run_dir(RUN_A)
    all_stats = {}
    for chunk in range(chunks):
        template = templates[chunk % len(templates)]
        stats = {**template, "chunk": chunk, "generate_started_at": 1.79e9 + chunk * 10.0,
                 "flow_run_id": f"flow-{chunk // FLOW_RUN_EVERY:05d}"}
        all_stats[chunk] = stats
        (run_a / chunk_stats_name(chunk)).write_text(json.dumps(stats))  # write_run_file's fsync is not measured
    for name in os.listdir(run_a):
        if name.startswith("stats-"):
            shutil.copy(run_a / name, store.run_dir(RUN_B) / name)
    every = chunk_stats.FOLD_CHUNKS  # as the flow leaves them: full segments, the rest (< FOLD_CHUNKS) as files
    for first in range(0, chunks - chunks % every, every):
        chunk_stats.fold(store, RUN_B, PRODUCER, {c: all_stats[c] for c in range(first, first + every)})
    files = {run: len([n for n in os.listdir(store.run_dir(run)) if n.startswith("stats-")]) for run in (RUN_A, RUN_B)}
    size = {run: sum(p.stat().st_size for p in store.run_dir(run).glob("stats-*")) for run in (RUN_A, RUN_B)}
    return {"seconds": time.perf_counter() - begin, "files": files, "bytes": size}


def chunk_stats_name(chunk: int) -> str:
    from factory.chunk_stats import chunk_stats_name as name

    return name(PRODUCER, chunk)


def measure(root: Path, run: str, chunk_items: int, curriculum: bool, part: str) -> dict:
    """One reader's costs in this process: "viewer", "summarize" or "sampler"."""
    from factory.store import ShardStore

    out = {}
    store = ShardStore(root)
    store.committed(run)  # the commit log is not what is measured
    if part == "viewer":
        from factory.viewer.index import RunIndex

        index = RunIndex(store, run)
        t = time.perf_counter()
        index._refresh_stats()
        out["viewer_first_s"] = time.perf_counter() - t
        t = time.perf_counter()
        drops = index.drops()
        out["drops_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(3):
            index.drops()
        out["drops_more_s"] = time.perf_counter() - t
        t = time.perf_counter()
        index._refresh_stats()
        out["viewer_again_s"] = time.perf_counter() - t
        out["kept"], out["flow_runs"] = drops["kept"], len(index.flow_runs())
    elif part == "summarize":
        from factory.datagen.summary import summarize

        cfg = SimpleNamespace(datagen=SimpleNamespace(run_id=run, producer=PRODUCER))
        t = time.perf_counter()
        summary = summarize(store, cfg, 1.0, Counter(), [])
        out["summarize_s"] = time.perf_counter() - t
        out["summary_kept"] = summary["groups_kept"]
    else:
        from environments.intern_bootcamp import InternBootcampConfig, InternBootcampEnv
        from factory.curriculum import CurriculumSettings
        from factory.sampling import DynamicSampling, make_curriculum

        env = InternBootcampEnv(InternBootcampConfig(difficulties=[3], group_size=8))
        t = time.perf_counter()
        sampler = DynamicSampling(store, run_id=run, producer=PRODUCER, chunk_items=chunk_items,
                                  total_items=chunk_items * 10**6,
                                  curriculum=make_curriculum(CurriculumSettings(enabled=curriculum), env,
                                                             start_level=3), solved=env.solved)
        out["sampler_start_s"] = time.perf_counter() - t
        out["items"] = sampler.committed_items
    return out


HERE = str(Path(__file__).resolve().parents[2])


def measure_in(tree: str, root: Path, run: str, chunk_items: int, curriculum: bool) -> dict:
    """`measure` of each reader in a fresh process whose `factory` is `tree`'s (this file is loaded by path, so a
    tree without it works too)."""
    out = {}
    for part in ("viewer", "summarize", "sampler"):
        out.update(_measure_in(tree, root, run, chunk_items, curriculum, part))
    return out


def _measure_in(tree: str, root: Path, run: str, chunk_items: int, curriculum: bool, part: str) -> dict:
    code = ("import importlib.util, json, sys; from pathlib import Path;"
            f"spec = importlib.util.spec_from_file_location('stats_fold', {__file__!r});"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m);"
            "print(json.dumps(m.measure(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == '1',"
            " sys.argv[5])))")
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code, str(root), run, str(chunk_items), "1" if curriculum else "0",
                           part],
                          env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


METRICS = [("viewer first look (_refresh_stats)", "viewer_first_s"), ("viewer drops()", "drops_s"),
           ("viewer drops() x3 more", "drops_more_s"),
           ("viewer second look (nothing new)", "viewer_again_s"), ("summarize", "summarize_s"),
           ("DynamicSampling start", "sampler_start_s")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk-items", type=int, default=100)
    parser.add_argument("--no-curriculum", action="store_true")
    parser.add_argument("--baseline", default=None, help="another code tree to read run A with (e.g. /work/main)")
    parser.add_argument("--scratch", default=None, help="where the store is built (default: a temp dir, removed)")
    parser.add_argument("--smoke", action="store_true", help="600 chunks, 1 round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.chunks, args.rounds = 600, 1
    from factory import chunk_stats

    curriculum = not args.no_curriculum
    scratch = Path(tempfile.mkdtemp(prefix="stats-fold-", dir=args.scratch))
    try:
        built = build(scratch, args.chunks, stats_templates(args.chunk_items, curriculum))
        print(f"# {args.chunks} chunks of {args.chunk_items} items, curriculum {'on' if curriculum else 'off'}, "
              f"FOLD_CHUNKS {chunk_stats.FOLD_CHUNKS}; built in {built['seconds']:.1f} s; stats files: "
              f"A {built['files'][RUN_A]} ({built['bytes'][RUN_A] / 2**20:.1f} MiB), "
              f"B {built['files'][RUN_B]} ({built['bytes'][RUN_B] / 2**20:.1f} MiB); load {os.getloadavg()}")
        variants = [("A", RUN_A, HERE), ("B", RUN_B, HERE)]
        if args.baseline:
            variants.insert(0, ("A0", RUN_A, str(Path(args.baseline).resolve())))
        results: dict[str, list[dict]] = {label: [] for label, _, _ in variants}
        for _ in range(args.rounds):
            for label, run, tree in variants:
                results[label].append(measure_in(tree, scratch, run, args.chunk_items, curriculum))
        first = {label: rows[0] for label, rows in results.items()}
        same = [key for key in ("kept", "flow_runs", "summary_kept", "items")
                if len({row[key] for row in first.values()}) != 1]
        a = first["A"]
        print(f"# same answers {'/'.join(results)}: {not same} (kept {a['kept']}, flow runs {a['flow_runs']}, "
              f"items {a['items']})" + (f"; DIFFER: {same}" if same else ""))
        pairs = [("B", "A")] + ([("B", "A0"), ("A", "A0")] if args.baseline else [])
        print("| reader | " + " | ".join(f"{label} (median s)" for label in results) + " | "
              + " | ".join(f"{x}/{y} per round (median, min-max)" for x, y in pairs) + " |")
        print("|---|" + "---:|" * len(results) + "---|" * len(pairs))
        for name, key in METRICS:
            cells = [f"{statistics.median(r[key] for r in results[label]):.4f}" for label in results]
            for x, y in pairs:
                ratios = [bx[key] / by[key] for bx, by in zip(results[x], results[y]) if by[key] > 0]
                cells.append(f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}x)"
                             if ratios else "-")
            print(f"| {name} | " + " | ".join(cells) + " |")
        print(f"# load {os.getloadavg()}")
        if same:
            raise SystemExit(1)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
