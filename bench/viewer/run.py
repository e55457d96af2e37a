"""view-run on a big store: cold index build, first page, each filter, text search, a group page, a live refresh.

    python -m bench.viewer.run                  # 1M groups of 8 sequences x 16-48 tokens (~1.5 GB, a few minutes)
    python -m bench.viewer.run --smoke          # 20k groups, seconds
    python -m bench.viewer.run --groups 200000 --pairs 3 --keep bench/out/viewer-store

The store is written directly with pyarrow in the shard store's format
(GROUP_SCHEMA, zstd, page checksums, 256-group row groups, commit log with
size and sha256): `ShardStore.commit` validates every group in Python, which
would take longer than the measurement. Requests go through the whole ASGI
app in-process (Starlette's test client: routing, templates, security
headers), so times are server time without the network. Each timed request
clears the viewer's facet/plot cache first, so nothing is served from a
previous answer; the index itself stays warm after the cold build, as in a
running server. Times are medians of `--pairs` requests through
`bench.harness.measure` (JSON lines in bench/results/viewer.jsonl).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.harness import add_bench_args, command_line, json_path, measure, pairs_from, print_table
from factory.schema import GROUP_SCHEMA
from factory.store import CommitRecord, shard_name

FAMILIES = ("arithmetic", "sorting", "cipher", "logic_grid", "word_count", "graph_path", "binary", "date_math")
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


def _list_array(offsets: np.ndarray, values: pa.Array) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)


def shard_table(first: int, count: int, group_size: int, rng: np.random.Generator, total: int) -> pa.Table:
    """`count` groups starting at index `first`, in GROUP_SCHEMA, built with numpy (no per-token Python)."""
    index = np.arange(first, first + count)
    sequences = count * group_size
    lengths = rng.integers(16, 49, sequences)
    inner = np.zeros(sequences + 1, dtype=np.int64)
    np.cumsum(lengths, out=inner[1:])
    tokens = rng.integers(0, 32000, int(inner[-1]), dtype=np.int32)
    position = np.arange(int(inner[-1])) - np.repeat(inner[:-1], lengths)
    masks = np.where(position < 8, -100, tokens).astype(np.int32)
    outer = np.arange(0, sequences + 1, group_size)
    scores = rng.choice(np.array([-0.5, 0.0, 1.0]), sequences)
    envs = np.where(index % 4 == 3, "gsm8k", "intern_bootcamp")
    families = [FAMILIES[i % len(FAMILIES)] for i in index]
    keys = [f"train-{i}" if i % 4 == 3 else f"{families[n]}:{i % 5 + 1}:{i}" for n, i in enumerate(index)]
    messages = []
    for n, i in enumerate(index):
        word = WORDS[i % len(WORDS)]
        prompt = f'{{"role": "user", "content": "Task {i} ({families[n]}): repeat the word {word} {i % 7 + 1} times."}}'
        messages.append("[" + ", ".join(
            f'[{prompt}, {{"role": "assistant", "content": "<think>counting</think> {word} x{k} answer {i + k}"}}]'
            for k in range(group_size)) + "]")
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    columns = {
        "group_id": pa.array([hashlib.sha256(str(i).encode()).hexdigest()[:32] for i in index]),
        "run_id": pa.array(["bench"] * count),
        "env": pa.array(envs.tolist()),
        "item_key": pa.array(keys),
        "policy_version": pa.array((index * 10 // max(total, 1)).astype(np.int64)),
        "created_at": pa.array([start + timedelta(seconds=int(i)) for i in index], type=pa.timestamp("us", tz="UTC")),
        "group_size": pa.array(np.full(count, group_size, dtype=np.int32)),
        "tokens": _list_array(outer, _list_array(inner, pa.array(tokens))),
        "masks": _list_array(outer, _list_array(inner, pa.array(masks))),
        "scores": _list_array(outer, pa.array(scores)),
        "messages": pa.array(messages, type=pa.large_string()),
        "generation_params": pa.array(['{"temperature": 1.0}'] * count, type=pa.large_string()),
    }
    arrays = [columns[f.name] if f.name in columns else pa.nulls(count, type=f.type) for f in GROUP_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=GROUP_SCHEMA)


def build_store(root: Path, groups: int, per_shard: int, group_size: int, run_id: str = "bench") -> float:
    """Write `groups` groups as committed shards of `per_shard`; returns seconds."""
    shards = root / run_id / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    with open(root / run_id / "commits.jsonl", "a", encoding="utf-8") as log:
        for chunk, first in enumerate(range(0, groups, per_shard)):
            count = min(per_shard, groups - first)
            commit_table(root, run_id, "bench", chunk, shard_table(first, count, group_size, rng, groups), log)
            if chunk % 100 == 99:
                print(f"  {first + count} groups written ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return time.perf_counter() - started


def commit_table(root: Path, run_id: str, producer: str, chunk: int, table: pa.Table, log) -> None:
    """What ShardStore.commit does on disk, for an Arrow table: write, hash, rename, log."""
    name = shard_name(producer, chunk)
    path = root / run_id / "shards" / name
    tmp = path.with_name(f".{name}.tmp")
    pq.write_table(table, tmp, compression="zstd", write_page_checksum=True, row_group_size=256)
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    os.replace(tmp, path)
    record = CommitRecord(shard=name, run_id=run_id, producer=producer, chunk=chunk, rows=table.num_rows,
                          bytes=path.stat().st_size, sha256=digest, committed_at=datetime.now(timezone.utc).isoformat())
    log.write(record.to_json() + "\n")
    log.flush()


def request_ms(client, viewer, url: str, last: dict) -> dict[str, float]:
    """One request with the viewer's facet/plot cache cleared; its text is kept in `last` for the match count."""
    viewer._cache.clear()
    started = time.perf_counter()
    response = client.get(url)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {response.status_code}")
    last["text"] = response.text
    return {"ms": elapsed * 1000}


def matched(text: str) -> str:
    start = text.find('<h3 id="matches">')
    if start < 0:
        return ""
    line = text[start + len('<h3 id="matches">'): text.find("</h3>", start)]
    return line.split("<span")[0].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=1_000_000)
    parser.add_argument("--per-shard", type=int, default=1000, help="Groups per shard (a datagen chunk).")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--keep", default=None, help="Store directory to build (or reuse if it exists) and keep.")
    add_bench_args(parser, pairs=5)
    args = parser.parse_args(argv)
    if args.smoke:
        args.groups = 20_000
    repeats = pairs_from(args)
    json_out = json_path("viewer", args)
    from starlette.testclient import TestClient

    from factory.viewer.app import ViewerConfig, create_app

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="viewer-bench-"))
    rows: list[list[object]] = []
    try:
        if (root / "bench" / "commits.jsonl").is_file():
            build_s = None
            print(f"reusing the store at {root}", file=sys.stderr)
        else:
            build_s = build_store(root, args.groups, args.per_shard, args.group_size)
        size = sum(p.stat().st_size for p in (root / "bench" / "shards").glob("*.parquet"))
        groups = sum(json.loads(line)["rows"] for line in open(root / "bench" / "commits.jsonl"))
        app = create_app(ViewerConfig(store=str(root)))
        viewer = app.viewer
        client = TestClient(app)
        last: dict = {}

        cold = measure("viewer", "first page, cold (indexes newest shards for 0.3 s)",
                       lambda: request_ms(client, viewer, "/run/bench", last), json_out=json_out, metric="ms")
        rows.append([cold.sides[0], round(cold.median(cold.sides[0], "ms"), 1), matched(last["text"])])
        index = viewer.index.indexed("bench")
        started = time.perf_counter()
        while index.pending:
            time.sleep(0.05)
        rows.append(["rest of the index (background), after the cold page", round((time.perf_counter() - started) * 1000), ""])
        group_id = index.frame["group_id"][-1]
        cases = [
            ("first page", "/run/bench"),
            ("page 100 (offset 4950)", "/run/bench?offset=4950"),
            ("filter env=gsm8k", "/run/bench?env=gsm8k"),
            ("filter task family=cipher", "/run/bench?family=cipher"),
            ("filter difficulty=3", "/run/bench?difficulty=3"),
            ("filter score range 0.2..0.6", "/run/bench?score_min=0.2&score_max=0.6"),
            ("filter policy version=7", "/run/bench?policy_version=7"),
            ("all filters at once", "/run/bench?env=intern_bootcamp&family=cipher&difficulty=3&policy_version=7&score_min=0"),
            ("text search, common ('foxtrot')", "/run/bench?text=foxtrot"),
            ("text search, rare ('Task 1234 (')", "/run/bench?text=Task+1234+%28"),
            ("text search + filters (cipher, 'charlie')", "/run/bench?family=cipher&text=charlie"),
            ("group page", f"/run/bench/group/{group_id}"),
            ("live status poll (nothing new)", "/api/run/bench/status"),
        ]
        loads = []
        for name, url in cases:
            result = measure("viewer", name, lambda url=url: request_ms(client, viewer, url, last), repeats=repeats,
                             json_out=json_out, metric="ms")
            loads.extend(load[0] for load in result.loads)
            rows.append([name, round(result.median(name, "ms"), 1), matched(last.get("text", ""))])
        with open(root / "bench" / "commits.jsonl", "a", encoding="utf-8") as log:
            commit_table(root, "bench", "live", len(index.shards) + index.pending,
                         shard_table(groups, args.per_shard, args.group_size, np.random.default_rng(1), groups), log)
        live = measure("viewer", "first page after a new shard (incremental index)",
                       lambda: request_ms(client, viewer, "/run/bench", last), json_out=json_out, metric="ms")
        rows.append([live.sides[0], round(live.median(live.sides[0], "ms"), 1), matched(last["text"])])
        index_mib = (index.frame.estimated_size() + sum(a.nbytes for a in vars(index.columns).values()
                                                        if isinstance(a, np.ndarray))) / 2**20
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\nview-run on {groups:,} groups of {args.group_size} sequences x 16-48 tokens, {size / 2**30:.2f} GiB in "
          f"{groups // args.per_shard} shards of {args.per_shard}" + (f" (built in {build_s:.0f} s)" if build_s else ""))
    print(f"index in RAM: {index_mib:.0f} MiB ({index_mib * 2**20 / max(groups, 1):.0f} B/group); peak RSS {peak:.0f} MiB; "
          f"median of {repeats} requests each, facet/plot caches cleared; "
          f"load1 {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cpus")
    print_table(["request", "ms", "matches"], rows)
    print(f"\ncommand: {command_line()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
