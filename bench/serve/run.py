"""Batching API side by side, interleaved: rollout-factory's run-api vs atroposlib 0.4.0's run-api.

    python -m bench.serve.run                # 3 interleaved pairs (atropos, ours, atropos, ours, ...), median ratios
    python -m bench.serve.run --record       # the same, appending the JSON lines to bench/results/serve.jsonl
    python -m bench.serve.run --pairs 5 --groups 2000
    ATROPOS_VENV=/work/.venv-atropos python -m bench.serve.run   # where the atroposlib venv already is
    python -m bench.serve.run --versus /tmp/base   # ours from another source tree vs this one, interleaved
    python -m bench.serve.run --versus /tmp/base --single-only --groups 2000   # the one-group phase only (1000 posts)
    python -m bench.serve.run --smoke        # seconds: tiny load, one pair (ours only if the Atropos venv is absent)
    python -m bench.serve.run --rss 1000,10000   # ours: server RSS after ingesting that many groups (8 clients, 64/request)
    python -m bench.serve.run --queue-rss 10000,100000   # ours: server RSS with that many groups queued from a followed run

Load per server start, by default on Atropos's own harness settings: groups of
8 sequences x 1024 tokens (tokens, masks, inference logprobs, messages), all
distinct, posted as plain JSON bodies by 8 concurrent clients, each holding one
persistent aiohttp session (one kept-alive connection), with no warm-up: first
one group per request, then 64 per request; then a trainer drains the queue
through /batch (256 sequences a batch; timed to the parsed JSON, and to the
gunzipped body before parsing, which is the server's part plus transfer and
gunzip). Server RSS is sampled every 50 ms: idle (registered, nothing queued),
peak during ingest, peak during the drain, and 1 s and 3 s after the queue is
empty (each once the server has answered a request: ours may be starting
again in place then, factory/serve/recycle.py, and a half-started process
would read low);
its anonymous part (RssAnon: heap, Python objects) is given beside idle and
after the drain, since the rest (RssFile) is mostly pages of the libraries the
first post loads (pyarrow, numpy: ~40 MiB that stay mapped for the process's
life, bench/RESULTS.md issue 29).
`--gzip`, `--session-per-post` and `--warmup N` bring back the older load
(gzip-9 bodies, a new session per post, N untimed posts first).

Ours acknowledges a post only once its groups are fsynced in a committed
Parquet shard; Atropos keeps them in memory. Each pair starts both servers
fresh on the same load, the two sides interleaved (atropos, ours, atropos, ...);
bench/harness.py prints medians over pairs and the median of the per-pair
ratios (ours / atropos), including each side's server CPU per group. JSON lines
go to a temporary directory unless `--record` (bench/results/serve.jsonl).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Load:
    """How the load generator posts: Atropos's harness settings by default."""

    gzip: bool = False
    """gzip-9 bodies (Atropos's env client compresses bodies of 1 KiB or more); off: plain JSON."""
    session_per_post: bool = False
    """A new aiohttp session (a new connection) per post; off: one persistent session per client."""
    warmup: int = 0
    """Untimed one-group posts before the timed ones."""
    clients: int = CLIENTS


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


def bodies(groups: list[dict], per_request: int, compress: bool = False) -> list[bytes]:
    """JSON bodies, plain or gzipped (level 9, as Atropos's env client's gzip.compress)."""
    out = []
    for start in range(0, len(groups), per_request):
        chunk = groups[start : start + per_request]
        body = orjson.dumps(chunk[0] if per_request == 1 else chunk)
        out.append(gzip.compress(body) if compress else body)
    return out


async def post_all(url: str, payloads: list[bytes], path: str, load: Load = Load()) -> float:
    """Seconds for `load.clients` concurrent clients to post every body (5xx and dropped connections are retried).

    Each client keeps one aiohttp session (a persistent connection) unless `load.session_per_post`, where each post
    opens its own, as atroposlib's BaseEnv._send_scored_data_to_api does."""
    queue = list(reversed(payloads))
    headers = {"Content-Type": "application/json", **({"Content-Encoding": "gzip"} if load.gzip else {})}
    timeout = aiohttp.ClientTimeout(total=300)

    async def post(session: aiohttp.ClientSession, body: bytes) -> None:
        while True:
            try:
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
        if load.session_per_post:
            while queue:
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    await post(session, queue.pop())
            return
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1)) as session:
            while queue:
                await post(session, queue.pop())

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(load.clients)))
    return time.perf_counter() - start


class RssSampler:
    """The server's RSS every 50 ms in a thread, peak per phase."""

    def __init__(self, pid: int) -> None:
        self.pid, self.phase, self.peaks = pid, "idle", {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                value = rss_mib(self.pid)
            except psutil.Error:
                return
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), value)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def rss_mib(pid: int) -> float:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) / (1 << 20)


def rss_anon_mib(pid: int) -> float:
    """RssAnon of the process tree (Linux; NaN elsewhere): RSS less the pages backed by files (shared libraries)."""
    process = psutil.Process(pid)
    total = 0.0
    for one in [process, *process.children(recursive=True)]:
        try:
            text = Path(f"/proc/{one.pid}/status").read_text()
        except OSError:
            return float("nan")
        total += next((int(line.split()[1]) for line in text.splitlines() if line.startswith("RssAnon:")), 0) / 1024
    return total


def cpu_s(pid: int) -> float:
    process = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [process, *process.children(recursive=True)])


def ours_command(port: int, root: str, tree: str | None = None) -> list[str]:
    """run-api from this tree, or (`tree`) from that source tree: -P keeps the working directory off sys.path."""
    return [sys.executable, *(["-P"] if tree else []), "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1",
            "--store_root", root, "--log_level", "warning"]


def atropos_command(port: int) -> list[str]:
    return [str(DEFAULT_VENV / "bin" / "run-api"), "--port", str(port)]


def measure(name: str, n_single: int, n_list: int, load: Load, tree: str | None = None,
            single_only: bool = False) -> dict[str, float]:
    """One fresh server of `name` ('ours' or 'atropos') through the whole load and a full drain; its metrics.
    `tree`: ours from that source tree (first on the server's PYTHONPATH) instead of this one. `single_only`: the
    one-group posts only (no 64-group posts, no drain)."""
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as root:
        port = free_port()
        command = ours_command(port, root, tree) if name == "ours" else atropos_command(port)
        singles = bodies(make_groups(n_single), 1, load.gzip)
        lists = bodies(make_groups(n_list, start=n_single), 64, load.gzip)
        warmup = bodies(make_groups(load.warmup, start=n_single + n_list), 1, load.gzip) if load.warmup else []
        server_env = {"PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])} if tree else None
        with ApiProcess(command, port, env=server_env, log_path=str(Path(root) / "api.log")) as api:
            trainer, env = TrainerClient(api.url, timeout=300), EnvClient(api.url, timeout=300)
            trainer.register(BATCH, max_token_len=SEQ_LEN * 2)
            trainer.batch()
            env.register("bench", GROUP_SIZE, max_token_length=SEQ_LEN)
            if warmup:
                asyncio.run(post_all(api.url, warmup, "/scored_data", load))
            pid = api.process.pid
            time.sleep(1.0)
            rss_idle, anon_idle = rss_mib(pid), rss_anon_mib(pid)
            sampler = RssSampler(pid)
            sampler.phase = "ingest"
            cpu0 = cpu_s(pid)
            t_single = asyncio.run(post_all(api.url, singles, "/scored_data", load))
            cpu1 = cpu_s(pid)
            if single_only:
                sampler.stop()
                return {"ingest groups/s (1 per request)": n_single / t_single,
                        "server CPU ms per group (1 per request)": 1000 * (cpu1 - cpu0) / n_single,
                        "server RSS MiB idle": rss_idle, "server RSS MiB after ingest": rss_mib(pid)}
            t_list = asyncio.run(post_all(api.url, lists, "/scored_data_list", load))
            cpu2 = cpu_s(pid)
            rss_ingested = rss_mib(pid)
            sampler.phase = "drain"
            latencies, received, sequences = [], [], 0
            with httpx.Client(base_url=api.url, timeout=300) as http:  # sends Accept-Encoding: gzip, as aiohttp does
                while True:
                    start = time.perf_counter()
                    reply = http.get("/batch")  # the whole body, gunzipped
                    elapsed = time.perf_counter() - start
                    batch = reply.json()["batch"]
                    if not batch:
                        break
                    received.append(elapsed)
                    latencies.append(time.perf_counter() - start)
                    sequences += sum(len(g["tokens"]) for g in batch)
                cpu3 = cpu_s(pid)
                posted = GROUP_SIZE * (n_single + n_list + load.warmup)
                if sequences < posted - BATCH:
                    raise RuntimeError(f"{name}: drained {sequences} of {posted} sequences")
                sampler.phase = "after drain"
                drained_at = time.perf_counter()
                time.sleep(1.0)
                httpx.get(api.url + "/", timeout=60)
                rss_drained, anon_drained = rss_mib(pid), rss_anon_mib(pid)
                time.sleep(max(0.0, drained_at + 3.0 - time.perf_counter()))
                httpx.get(api.url + "/", timeout=60)  # the server answers: not half-way through a start
                rss_settled, anon_settled = rss_mib(pid), rss_anon_mib(pid)
            sampler.stop()
            return {
                "ingest groups/s (1 per request)": n_single / t_single,
                "ingest groups/s (64 per request)": n_list / t_list,
                "server CPU ms per group (1 per request)": 1000 * (cpu1 - cpu0) / n_single,
                "server CPU ms per group (64 per request)": 1000 * (cpu2 - cpu1) / n_list,
                "server CPU ms per batch (drain)": 1000 * (cpu3 - cpu2) / max(1, len(latencies)),
                "/batch p50 ms": 1000 * statistics.median(latencies),
                "/batch p99 ms": 1000 * p99(latencies),
                "/batch p50 ms before JSON decode": 1000 * statistics.median(received),
                "/batch p99 ms before JSON decode": 1000 * p99(received),
                "server RSS MiB idle": rss_idle,
                "server RSS MiB after ingest": rss_ingested,
                "server RSS MiB peak during ingest": sampler.peaks.get("ingest", rss_ingested),
                "server RSS MiB peak during drain": sampler.peaks.get("drain", rss_ingested),
                "server RSS MiB 1 s after the drain": rss_drained,
                "server RSS MiB 3 s after the drain": rss_settled,
                "server RssAnon MiB idle": anon_idle,
                "server RssAnon MiB 1 s after the drain": anon_drained,
                "server RssAnon MiB 3 s after the drain": anon_settled,
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
    parser.add_argument("--skip-atropos", action="store_true")
    parser.add_argument("--record", action="store_true",
                        help="append the JSON lines to bench/results/serve.jsonl (default: a temporary directory)")
    parser.add_argument("--gzip", action="store_true", help="gzip-9 bodies (default: plain JSON, Atropos's harness)")
    parser.add_argument("--session-per-post", action="store_true",
                        help="a new aiohttp session per post (default: one persistent session per client)")
    parser.add_argument("--warmup", type=int, default=0, help="untimed one-group posts first (default 0)")
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--native-ab", action="store_true",
                        help="ours only, two sides: the native number reader (numjson) vs msgspec alone "
                        "(FACTORY_NATIVE_JSON=0), interleaved")
    parser.add_argument("--versus", default=None, metavar="TREE",
                        help="ours only, two sides: ours from source tree TREE (e.g. `git archive` of a base commit, "
                        "with its built factory/serve/_numjson*.so) vs this tree, interleaved")
    parser.add_argument("--single-only", action="store_true",
                        help="only the one-group-per-request phase (half of --groups posts): no 64-group posts, no drain")
    parser.add_argument("--rss", default=None, help="comma-separated group counts: ours' RSS curve instead of the comparison")
    parser.add_argument("--queue-rss", default=None, help="comma-separated queued-group counts: ours' RSS with that many queued")
    args = parser.parse_args(argv)
    if args.rss:
        rss_curve([int(c) for c in args.rss.split(",")])
        return
    if args.queue_rss:
        queue_rss([int(c) for c in args.queue_rss.split(",")])
        return
    n_list = 64 if args.smoke else args.groups
    n_single = 16 if args.smoke else max(64, n_list // 2)
    n_list = max(64, n_list // 64 * 64)
    load = Load(gzip=args.gzip, session_per_post=args.session_per_post, warmup=args.warmup, clients=args.clients)
    later = "then nothing (--single-only)" if args.single_only else f"{n_list} groups 64 per request"
    if args.record or args.json_out or args.smoke:
        json_out = json_path("serve", args)
    else:
        json_out = Path(tempfile.gettempdir()) / "rollout-factory-bench" / "serve.jsonl"
    if args.native_ab:
        def ours_with(native: str) -> dict[str, float]:
            os.environ["FACTORY_NATIVE_JSON"] = native  # the server process inherits it
            try:
                return measure("ours", n_single, n_list, load, single_only=args.single_only)
            finally:
                os.environ.pop("FACTORY_NATIVE_JSON", None)

        result = compare("serve-native", [Side("ours, msgspec only", lambda: ours_with("0")),
                                          Side("ours, numjson.c", lambda: ours_with("1"))],
                         pairs=pairs_from(args), json_out=json_out)
        print_comparison(result, json_out=json_out, title=f"Native number reader vs msgspec: {n_single} groups 1 per "
                         f"request, {n_list} groups 64 per request, {load.clients} clients")
        return
    if args.versus:
        tree = str(Path(args.versus).resolve())
        result = compare("serve-versus", [
            Side(f"ours @ {args.versus}", lambda: measure("ours", n_single, n_list, load, tree, args.single_only)),
            Side("ours @ this tree", lambda: measure("ours", n_single, n_list, load, single_only=args.single_only))],
                         pairs=pairs_from(args), json_out=json_out)
        print_comparison(result, json_out=json_out, title=f"Ours vs ours from {tree}: {n_single} groups 1 per request, "
                         f"{later}, {load.clients} clients")
        return
    with_atropos = not args.skip_atropos and atropos_available()
    if not with_atropos and not args.skip_atropos:
        print(f"[bench] no atroposlib venv at {DEFAULT_VENV} (python -m bench.atropos_venv makes it): ours only", file=sys.stderr)
    sides = [Side("atroposlib 0.4.0", lambda: measure("atropos", n_single, n_list, load, single_only=args.single_only))
             ] if with_atropos else []
    sides.append(Side("rollout-factory", lambda: measure("ours", n_single, n_list, load, single_only=args.single_only)))
    result = compare("serve", sides, pairs=pairs_from(args), json_out=json_out)
    bodies_are = ("gzip-9" if load.gzip else "plain JSON") + (", a new session per post" if load.session_per_post
                                                               else ", one persistent session per client")
    print_comparison(result, json_out=json_out, title=(
        f"Batching API: {n_single} groups 1 per request, {later}, {load.clients} clients, "
        f"{bodies_are}, warm-up {load.warmup} posts, {GROUP_SIZE}x{SEQ_LEN} tokens per group, drained in batches "
        f"of {BATCH}"))


if __name__ == "__main__":
    main()
