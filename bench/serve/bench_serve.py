"""Batching API side by side: rollout-factory's run-api vs atroposlib 0.4.0's run-api on the same load.

    python -m bench.serve.bench_serve                 # full run (both servers), prints a table
    python -m bench.serve.bench_serve --quick         # smaller load while developing
    python -m bench.serve.bench_serve --rss-only      # ours: server RSS with 0 / 10k / 100k queued groups

Load: groups of 8 sequences x 1024 tokens, 8 concurrent env clients posting
pre-encoded bodies (gzip as Atropos's env client sends them), then a trainer
pulling /batch of 256 sequences. Ours persists every group to Parquet before
acknowledging it; Atropos keeps them in memory.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import psutil

from bench.atropos_venv import atropos_python
from factory.serve.client import ApiProcess, EnvClient, TrainerClient
from factory.store import ShardStore
from factory.synthetic import synthetic_groups
from tests.conftest import free_port

GROUP_SIZE, SEQ_LEN, BATCH, CLIENTS = 8, 1024, 256, 8


def make_bodies(count: int, per_request: int) -> list[bytes]:
    """Distinct groups (one token changed per copy), JSON + gzip level 9 like Atropos's env client."""
    base = [orjson.loads(orjson.dumps(g.wire_dict())) for g in synthetic_groups(16, group_size=GROUP_SIZE, seq_len=SEQ_LEN)]
    groups = []
    for i in range(count):
        group = dict(base[i % len(base)])
        group["tokens"] = [[i, *group["tokens"][0][1:]], *group["tokens"][1:]]
        group["env_id"] = 0
        groups.append(group)
    bodies = []
    for start in range(0, count, per_request):
        chunk = groups[start : start + per_request]
        bodies.append(gzip.compress(orjson.dumps(chunk[0] if per_request == 1 else chunk)))
    return bodies


async def ingest(url: str, bodies: list[bytes], path: str) -> float:
    queue = list(bodies)
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            while queue:
                body = queue.pop()
                reply = await http.post(path, content=body, headers=headers)
                reply.raise_for_status()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return time.perf_counter() - start


def rss_mib(pid: int) -> float:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) / (1 << 20)


def bench_server(name: str, api: ApiProcess, n_single: int, n_list: int, n_batches: int) -> dict[str, float]:
    trainer, env = TrainerClient(api.url, timeout=300), EnvClient(api.url, timeout=300)
    trainer.register(BATCH, max_token_len=SEQ_LEN * 2)
    trainer.batch()
    env.register("bench", GROUP_SIZE, max_token_length=SEQ_LEN)
    singles, lists = make_bodies(n_single, 1), make_bodies(n_list, 64)
    rss0 = rss_mib(api.process.pid)
    t_single = asyncio.run(ingest(api.url, singles, "/scored_data"))
    time.sleep(0.5)
    rss_mid = rss_mib(api.process.pid)
    t_list = asyncio.run(ingest(api.url, lists, "/scored_data_list"))
    time.sleep(0.5)
    rss1 = rss_mib(api.process.pid)
    latencies = []
    http = httpx.Client(base_url=api.url, timeout=300)  # sends Accept-Encoding: gzip, like aiohttp/requests
    for _ in range(n_batches):
        start = time.perf_counter()
        reply = http.get("/batch")
        batch = reply.json()["batch"]
        latencies.append(time.perf_counter() - start)
        assert batch and sum(len(g["tokens"]) for g in batch) == BATCH, f"{name}: short batch"
    latencies.sort()
    return {
        "ingest groups/s (1 per request)": n_single / t_single,
        "ingest groups/s (64 per request)": n_list / t_list,
        "/batch p50 ms": 1000 * statistics.median(latencies),
        "/batch p99 ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "/batch batches/s": n_batches / sum(latencies),
        "RSS MiB after ingest (0 at start)": rss1 - rss0,
        # Slope while the queue grows from n_single to n_single + n_list groups (warm-up and
        # allocator high-water marks of the first phase excluded).
        "RSS MiB per 1000 more queued groups": (rss1 - rss_mid) / n_list * 1000,
    }


def rss_only(counts: list[int]) -> None:
    """Ours: RSS with many queued groups (small groups: the index does not hold payloads, so size doesn't matter)."""
    with tempfile.TemporaryDirectory() as root:
        store = ShardStore(root)
        groups = list(synthetic_groups(1000, group_size=GROUP_SIZE, seq_len=16))
        port = free_port()
        command = [sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1",
                   "--store_root", root, "--follow_runs", "[gen]", "--log_level", "warning"]
        with ApiProcess(command, port) as api:
            print("| queued groups | server RSS MiB |\n|---:|---:|")
            print(f"| 0 | {rss_mib(api.process.pid):.0f} |")
            chunk = 0
            for target in counts:
                while chunk * 1000 < target:
                    store.commit("gen", "w", chunk, groups)
                    chunk += 1
                while httpx.get(api.url + "/status").json()["queue_size"] < target:
                    time.sleep(0.2)
                time.sleep(1.0)
                print(f"| {target} | {rss_mib(api.process.pid):.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller load")
    parser.add_argument("--rss-only", action="store_true", help="only our RSS at 10k/100k queued groups")
    parser.add_argument("--skip-atropos", action="store_true")
    args = parser.parse_args()
    if args.rss_only:
        rss_only([10_000, 100_000])
        return
    n_single, n_list, n_batches = (160, 512, 10) if args.quick else (800, 2048, 40)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as root:
        port = free_port()
        ours = [sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1",
                "--store_root", root, "--log_level", "warning"]
        with ApiProcess(ours, port, log_path=str(Path(root) / "ours.log")) as api:
            results["rollout-factory"] = bench_server("ours", api, n_single, n_list, n_batches)
    if not args.skip_atropos:
        port = free_port()
        run_api = str(Path(atropos_python()).parent / "run-api")
        with ApiProcess([run_api, "--port", str(port)], port) as api:
            results["atroposlib 0.4.0"] = bench_server("atropos", api, n_single, n_list, n_batches)
    names = list(results)
    metrics = list(results[names[0]])
    header = "| metric | " + " | ".join(names) + (" | ratio (ours / atropos) |" if len(names) == 2 else " |")
    print(header)
    print("|---" * (len(names) + 1 + (len(names) == 2)) + "|")
    for metric in metrics:
        values = [results[n][metric] for n in names]
        row = f"| {metric} | " + " | ".join(f"{v:.1f}" for v in values)
        if len(names) == 2:
            row += f" | {values[0] / values[1]:.2f}x" if values[1] else " | -"
        print(row + " |")


if __name__ == "__main__":
    main()
