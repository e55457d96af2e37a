"""Batching API side by side, interleaved: rollout-factory's run-api vs atroposlib 0.4.0's run-api.

    python -m bench.serve.run                # 3 interleaved pairs (atropos, ours, atropos, ours, ...), median ratios
    python -m bench.serve.run --pairs 5 --groups 2000
    ATROPOS_VENV=/work/.venv-atropos python -m bench.serve.run   # where the atroposlib venv already is
    python -m bench.serve.run --smoke        # seconds: tiny load, one pair (ours only if the Atropos venv is absent)
    python -m bench.serve.run --rss 1000,10000   # ours: server RSS after ingesting that many groups (8 clients, 64/request)
    python -m bench.serve.run --queue-rss 10000,100000   # ours: server RSS with that many groups queued from a followed run

Load per server start: groups of 8 sequences x 1024 tokens (tokens, masks,
inference logprobs, messages), all distinct, posted by 8 concurrent clients
as Atropos's env client sends them (aiohttp, a new session per post, JSON
gzipped by gzip.compress), after 64 untimed one-group posts (warm-up, both
sides), first one group per request, then 64 per request; then a trainer
pulls /batch (256 sequences; timed to the parsed JSON, and to the gunzipped body before
parsing, which is the server's part plus transfer and gunzip). Ours
acknowledges a post only once its groups are fsynced in a committed Parquet
shard; Atropos keeps them in memory. Each pair starts both servers fresh on
the same load; bench/harness.py prints medians over pairs and the median of
the per-pair ratios (ours / atropos) and writes every measurement as a JSON line.
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

import aiohttp
import httpx
import orjson
import psutil

from bench.atropos_venv import DEFAULT_VENV, atropos_available
from bench.harness import Side, add_bench_args, compare, json_path, pairs_from, print_comparison
from factory.serve.client import ApiProcess, EnvClient, TrainerClient
from factory.store import ShardStore
from factory.synthetic import synthetic_groups
from tests.conftest import free_port

GROUP_SIZE, SEQ_LEN, BATCH, CLIENTS = 8, 1024, 256, 8
WARMUP_GROUPS = 64


def make_groups(count: int, start: int = 0, seq_len: int = SEQ_LEN) -> list[dict]:
    """Distinct groups: 16 synthetic templates, the first token of each copy set to its index."""
    base = [orjson.loads(orjson.dumps(g.wire_dict())) for g in synthetic_groups(16, group_size=GROUP_SIZE, seq_len=seq_len)]
    groups = []
    for i in range(start, start + count):
        group = dict(base[i % len(base)])
        group["tokens"] = [[i, *group["tokens"][0][1:]], *group["tokens"][1:]]
        group["env_id"] = 0
        groups.append(group)
    return groups


def bodies(groups: list[dict], per_request: int) -> list[bytes]:
    """gzip (level 9 by default, as Atropos's env client's gzip.compress) JSON bodies."""
    out = []
    for start in range(0, len(groups), per_request):
        chunk = groups[start : start + per_request]
        out.append(gzip.compress(orjson.dumps(chunk[0] if per_request == 1 else chunk)))
    return out


async def post_all(url: str, payloads: list[bytes], path: str, clients: int = CLIENTS) -> float:
    """Seconds for `clients` concurrent clients to post every body (5xx and dropped connections are retried).

    Each post opens its own aiohttp session, as atroposlib's BaseEnv._send_scored_data_to_api does (the
    load generator's own CPU then stays small: httpx spent ~1.7 ms per one-group post, aiohttp ~0.3-0.5)."""
    queue = list(reversed(payloads))
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=300)

    async def post(body: bytes) -> None:
        while True:
            try:
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    async with session.post(url + path, data=body, headers=headers) as reply:
                        await reply.read()
                        if reply.status >= 500:
                            await asyncio.sleep(float(reply.headers.get("retry-after", "0.2")))
                            continue
                        if reply.status != 200:
                            raise RuntimeError(f"{path} answered {reply.status}: {(await reply.text())[:300]}")
                        return
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.2)

    async def client() -> None:
        while queue:
            await post(queue.pop())

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - start


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def rss_mib(pid: int) -> float:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) / (1 << 20)


def cpu_s(pid: int) -> float:
    process = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [process, *process.children(recursive=True)])


def ours_command(port: int, root: str) -> list[str]:
    return [sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1", "--store_root", root,
            "--log_level", "warning"]


def atropos_command(port: int) -> list[str]:
    return [str(DEFAULT_VENV / "bin" / "run-api"), "--port", str(port)]


def measure(name: str, n_single: int, n_list: int, n_batches: int) -> dict[str, float]:
    """One fresh server of `name` ('ours' or 'atropos') through the whole load; its metrics."""
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as root:
        port = free_port()
        command = ours_command(port, root) if name == "ours" else atropos_command(port)
        with ApiProcess(command, port, log_path=str(Path(root) / "api.log")) as api:
            trainer, env = TrainerClient(api.url, timeout=300), EnvClient(api.url, timeout=300)
            trainer.register(BATCH, max_token_len=SEQ_LEN * 2)
            trainer.batch()
            env.register("bench", GROUP_SIZE, max_token_length=SEQ_LEN)
            singles = bodies(make_groups(n_single), 1)
            lists = bodies(make_groups(n_list, start=n_single), 64)
            # Both servers first take 64 posts that are not timed (first-call costs: imports, allocator, caches):
            # the figures are steady-state rates.
            asyncio.run(post_all(api.url, bodies(make_groups(WARMUP_GROUPS, start=n_single + n_list), 1), "/scored_data"))
            pid = api.process.pid
            rss0, cpu0 = rss_mib(pid), cpu_s(pid)
            t_single = asyncio.run(post_all(api.url, singles, "/scored_data"))
            cpu1 = cpu_s(pid)
            t_list = asyncio.run(post_all(api.url, lists, "/scored_data_list"))
            cpu2 = cpu_s(pid)
            rss1 = rss_mib(pid)
            latencies, received = [], []
            with httpx.Client(base_url=api.url, timeout=300) as http:  # sends Accept-Encoding: gzip, as aiohttp does
                for _ in range(n_batches):
                    start = time.perf_counter()
                    reply = http.get("/batch")  # the whole body, gunzipped
                    received.append(time.perf_counter() - start)
                    batch = reply.json()["batch"]
                    latencies.append(time.perf_counter() - start)
                    assert batch and sum(len(g["tokens"]) for g in batch) == BATCH, f"{name}: short batch"
            return {
                "ingest groups/s (1 per request)": n_single / t_single,
                "ingest groups/s (64 per request)": n_list / t_list,
                "server CPU ms per group (1 per request)": 1000 * (cpu1 - cpu0) / n_single,
                "server CPU ms per group (64 per request)": 1000 * (cpu2 - cpu1) / n_list,
                "/batch p50 ms": 1000 * statistics.median(latencies),
                "/batch p99 ms": 1000 * p99(latencies),
                "/batch p50 ms before JSON decode": 1000 * statistics.median(received),
                "/batch p99 ms before JSON decode": 1000 * p99(received),
                "server RSS MiB after ingest": rss1,
                "server RSS MiB growth during ingest": rss1 - rss0,
            }


def rss_curve(counts: list[int], seq_len: int = SEQ_LEN) -> None:
    """Ours: server RSS after ingesting each count of groups (8 clients, 64 groups per request, all acknowledged).

    The same 64-group body is posted again and again (making 100k distinct gzipped bodies takes longer than
    ingesting them): deduplication is by client identity only, so every post is stored as new groups."""
    body = bodies(make_groups(64, seq_len=seq_len), 64)[0]
    with tempfile.TemporaryDirectory(prefix="bench-serve-rss-") as root:
        port = free_port()
        with ApiProcess(ours_command(port, root), port, log_path=str(Path(root) / "api.log")) as api:
            print("| groups ingested | server RSS MiB | peak ingest bytes in use MiB | seconds |\n|---:|---:|---:|---:|")
            print(f"| 0 | {rss_mib(api.process.pid):.0f} | 0 | 0 |")
            done, started = 0, time.perf_counter()
            for target in counts:
                while done < target:
                    step = min(4096, target - done) // 64 * 64 or 64
                    asyncio.run(post_all(api.url, [body] * (step // 64), "/scored_data_list"))
                    done += step
                status = httpx.get(api.url + "/status").json()
                assert status["queue_size"] == done, status
                peak = status["ingest"]["peak_in_use_bytes"] / (1 << 20)
                print(f"| {done} | {rss_mib(api.process.pid):.0f} | {peak:.0f} | {time.perf_counter() - started:.0f} |", flush=True)


def queue_rss(counts: list[int]) -> None:
    """Ours: server RSS with many groups queued from a followed run (the queue is an index, so group size does not matter)."""
    groups = list(synthetic_groups(1000, group_size=GROUP_SIZE, seq_len=16))
    with tempfile.TemporaryDirectory(prefix="bench-serve-queue-") as root:
        store = ShardStore(root)
        port = free_port()
        command = [*ours_command(port, root), "--follow_runs", "[gen]"]
        with ApiProcess(command, port, log_path=str(Path(root) / "api.log")) as api:
            print("| queued groups | server RSS MiB |\n|---:|---:|")
            print(f"| 0 | {rss_mib(api.process.pid):.0f} |")
            chunk = 0
            for target in counts:
                while chunk * len(groups) < target:
                    store.commit("gen", "w", chunk, groups)
                    chunk += 1
                while httpx.get(api.url + "/status").json()["queue_size"] < target:
                    time.sleep(0.2)
                print(f"| {chunk * len(groups)} | {rss_mib(api.process.pid):.0f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(parser)
    parser.add_argument("--groups", type=int, default=2000, help="groups posted 64 per request (half as many 1 per request)")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--skip-atropos", action="store_true")
    parser.add_argument("--rss", default=None, help="comma-separated group counts: ours' RSS curve instead of the comparison")
    parser.add_argument("--queue-rss", default=None, help="comma-separated queued-group counts: ours' RSS with that many queued")
    args = parser.parse_args(argv)
    if args.rss:
        rss_curve([int(c) for c in args.rss.split(",")])
        return
    if args.queue_rss:
        queue_rss([int(c) for c in args.queue_rss.split(",")])
        return
    n_list, n_batches = (64, 2) if args.smoke else (args.groups, args.batches)
    n_single = 16 if args.smoke else max(64, n_list // 2)
    n_list = max(64, n_list // 64 * 64)
    with_atropos = not args.skip_atropos and atropos_available()
    if not with_atropos and not args.skip_atropos:
        print(f"[bench] no atroposlib venv at {DEFAULT_VENV} (python -m bench.atropos_venv makes it): ours only", file=sys.stderr)
    sides = [Side("atroposlib 0.4.0", lambda: measure("atropos", n_single, n_list, n_batches))] if with_atropos else []
    sides.append(Side("rollout-factory", lambda: measure("ours", n_single, n_list, n_batches)))
    result = compare("serve", sides, pairs=pairs_from(args), json_out=json_path("serve", args))
    print_comparison(result, title=(
        f"Batching API: {n_single} groups 1 per request, {n_list} groups 64 per request, {CLIENTS} clients, "
        f"{GROUP_SIZE}x{SEQ_LEN} tokens per group, {n_batches} batches of {BATCH}"))


if __name__ == "__main__":
    main()
