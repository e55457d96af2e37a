"""Where a warm datagen flow call's CPU goes beyond the plain worker's: per thread, per function, per API call.

    OMP_NUM_THREADS=1 python -m bench.datagen.flow_profile --groups 1000 --calls 3 --plain --chunk-items 250,1000
    python -m bench.datagen.flow_profile --smoke
    python -m bench.datagen.flow_profile --groups 1000 --calls 3 --cprofile 40   # plus cProfile over every thread
    python -m bench.datagen.flow_profile --groups 1000 --calls 3 --plain --versus /tmp/base --pairs 2  # A/B

`--versus CHECKOUT` runs this profile on CHECKOUT's code (A) and this checkout's (B) in alternating child
processes, A,B per round, against one Prefect server, and prints per round each side's warm flow and plain-worker
CPU per group, the orchestration share and the rows written (count and content hash, which must match).

`--server-token-ids`: the instant server returns token ids to requests that ask (vLLM's `return_token_ids`) and
the flow and plain worker ask (server_type vllm). With `--versus`, both sides call one instant server started by
the parent; B gets the option, and A too where its flow_profile takes it (a checkout from before issue 33's token-id
requests asks for none and tokenizes locally: then the A/B is "before" against "after, on a server that returns ids").

One process, one Prefect server, the instant server; the flow (`intern_bootcamp_datagen`, inline scoring, thread
pool) is called `--calls` times and the first call (imports, tokenizer, Prefect engine start) is left out. For
each warm call: the process CPU per group, each thread's CPU (main thread, task threads, Prefect's own loops),
and the Prefect API requests it made, by method and path. `--cprofile N` profiles every thread (a profiler is
started in each new thread), so its absolute times are inflated; read the shares.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import harness

PROFILES: list[tuple[str, cProfile.Profile]] = []


def _start_profile(*_: Any) -> None:
    # CPU of the thread, not wall time (BENCH_PROFILE_WALL=1: wall time, to see where a call waits)
    profile = cProfile.Profile(time.perf_counter if os.environ.get("BENCH_PROFILE_WALL") else time.thread_time)
    PROFILES.append((thread_kind(threading.current_thread().name), profile))
    profile.enable()  # replaces this bootstrap hook in this thread


def thread_cpu() -> dict[str, float]:
    """CPU seconds of every live thread, keyed by name and ident."""
    out = {}
    for thread in threading.enumerate():
        try:
            out[f"{thread.name}#{thread.ident}"] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, TypeError):
            pass
    return out


def thread_kind(name: str) -> str:
    name = name.split("#")[0]
    if name == "MainThread":
        return "main (flow body, commits)"
    if "ThreadPoolTaskRunner" in name or name.startswith("ThreadPoolExecutor"):
        return "task threads (task bodies + engine)"
    return f"other: {name.rstrip('0123456789-_')}"


API_CALLS: Counter[str] = Counter()
PLAIN: dict[int, list[float]] = {}
GC: Counter[str] = Counter()
_gc_started: list[float] = []


def _gc_clock(phase: str, info: dict[str, Any]) -> None:
    """Thread CPU and count of the garbage collector's passes, by generation."""
    if phase == "start":
        _gc_started.append(time.thread_time())
    elif _gc_started:
        GC[f"gen{info['generation']} s"] += time.thread_time() - _gc_started.pop()
        GC[f"gen{info['generation']} n"] += 1


def count_api_calls() -> None:
    """Count every request Prefect's HTTP clients send (method + path, ids collapsed)."""
    import re

    from prefect.client.base import PrefectHttpxAsyncClient, PrefectHttpxSyncClient

    def key(request: Any) -> str:
        path = re.sub(r"[0-9a-f]{8}-[0-9a-f-]{27}", "<id>", request.url.path)
        return f"{request.method} {path}"

    original_async, original_sync = PrefectHttpxAsyncClient.send, PrefectHttpxSyncClient.send

    async def send_async(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        API_CALLS[key(request)] += 1
        return await original_async(self, request, *args, **kwargs)

    def send_sync(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        API_CALLS[key(request)] += 1
        return original_sync(self, request, *args, **kwargs)

    PrefectHttpxAsyncClient.send, PrefectHttpxSyncClient.send = send_async, send_sync


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=1000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="seconds: 32 groups, 2 calls (checks that it runs)")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N", help="print cProfile's top N (all threads)")
    parser.add_argument("--dump", default="", help="write the combined cProfile stats to this file (pstats)")
    parser.add_argument("--sort", default="tottime", help="pstats sort keys, comma-separated: one table each")
    parser.add_argument("--threads", default="", help="only threads whose kind contains this (e.g. main, task)")
    parser.add_argument("--datagen", default="", help="extra datagen settings, k=v,k=v (e.g. chunk_items=500)")
    parser.add_argument("--plain", action="store_true",
                        help="also run the plain worker (bench.datagen.stages, no Prefect) before each flow call "
                             "on the same groups: orchestration = flow CPU - plain CPU, warm, in one process")
    parser.add_argument("--refreeze", action="store_true",
                        help="experiment: gc.collect(); gc.freeze() after the first (cold) flow call")
    parser.add_argument("--gc-threshold", type=int, default=0, help="experiment: gc.set_threshold(N, 10, 10)")
    parser.add_argument("--chunk-items", default="",
                        help="comma-separated chunk sizes to compare, interleaved per call (default: groups/4)")
    parser.add_argument("--versus", type=Path, metavar="CHECKOUT",
                        help="before/after: CHECKOUT's code (A) and this one's (B) in alternating child processes")
    parser.add_argument("--pairs", type=int, default=2, help="A,B rounds for --versus")
    parser.add_argument("--server-token-ids", action="store_true",
                        help="the server returns token ids and the flow asks for them (vLLM's return_token_ids)")
    parser.add_argument("--record-line", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)  # --versus: the parent's instant server
    args = parser.parse_args(argv)
    if args.versus is not None:
        return versus(args, argv)
    if args.smoke:
        args.groups, args.calls = min(args.groups, 32), 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    extra: dict[str, Any] = {}
    for pair in filter(None, args.datagen.split(",")):
        k, v = pair.split("=", 1)
        extra[k] = int(v) if v.isdigit() else v
    if args.cprofile:
        threading.setprofile(_start_profile)
        _start_profile()
    from bench.datagen.run import ROWS_WRITTEN, InstantServer, factory_flow, tiny_policy

    import contextlib

    work = Path(tempfile.mkdtemp(prefix="bench-flowprof-"))
    tokenizer = tiny_policy()
    ids = {"server_type": "vllm"} if args.server_token_ids else {}  # not passed at all otherwise (older checkouts)
    if args.url:
        instant = contextlib.nullcontext(type("Given", (), {"base_url": args.url})())
    else:
        instant = InstantServer(1, tokenizer=tokenizer) if args.server_token_ids else InstantServer(1)
    with harness.prefect_server(work / "prefect"), instant as server:
        count_api_calls()
        import gc

        gc.callbacks.append(_gc_clock)
        if args.gc_threshold:
            gc.set_threshold(args.gc_threshold, 10, 10)
        variants = [int(c) for c in args.chunk_items.split(",") if c] or [max(args.groups // 4, 1)]
        per_variant: dict[int, list[tuple[float, float, float]]] = {c: [] for c in variants}
        for call in range(args.calls * len(variants)):
            chunk_items = variants[call % len(variants)]
            if args.plain:
                from bench.datagen import stages

                plain = stages.plain_worker(server.base_url, args.groups, args.group_size, chunk_items,
                                            str(tokenizer), work / f"plain-{call}", stages.StageClock(), **ids)
                plain_us = 1e6 * plain["process_cpu_s"] / args.groups
                print(f"plain worker (chunk_items {chunk_items}): {plain_us:.0f} us/group process CPU, "
                      f"sha {plain['content_sha256'][:16]}")
                if call >= len(variants):
                    PLAIN.setdefault(chunk_items, []).append(plain_us)
            if call == len(variants) and args.refreeze:
                gc.collect()
                gc.freeze()
            if call == len(variants):
                for _, profile in PROFILES:
                    profile.clear()
            API_CALLS.clear()
            GC.clear()
            before = thread_cpu()
            result = factory_flow(server.base_url, args.groups, args.group_size, tokenizer, work / "store", "inline",
                                  score_mode="inline", **ids, **{"chunk_items": chunk_items, **extra})
            if call >= len(variants):  # the first call of each is start-up (imports, tokenizer, engine)
                per_variant[chunk_items].append((result["process CPU us/group"], result["groups/s"],
                                                 result["groups/s, pipeline only"]))
            after = thread_cpu()
            by_kind: Counter[str] = Counter()
            for name, cpu in after.items():
                by_kind[thread_kind(name)] += cpu - before.get(name, 0.0)
            print(f"call {call} (chunk_items {chunk_items}): "
                  f"{result['process CPU us/group']:.0f} us/group process CPU, "
                  f"{result['groups/s']:.1f} groups/s; rows {ROWS_WRITTEN[-1]['rows']} "
                  f"sha {ROWS_WRITTEN[-1]['sha256'][:16]}")
            live = sum(by_kind.values())
            by_kind["threads that ended (task threads: bodies + engine)"] = (
                result["process CPU us/group"] * args.groups / 1e6 - live)
            for kind, cpu in by_kind.most_common():
                print(f"   {kind:45s} {1e6 * cpu / args.groups:8.0f} us/group  ({cpu:.3f} s)")
            print("   garbage collector: " + ", ".join(f"gen{g}: {GC[f'gen{g} n']} passes {GC[f'gen{g} s']:.3f} s"
                                                      for g in range(3)))
            print(f"   Prefect API requests: {sum(API_CALLS.values())}")
            for what, n in API_CALLS.most_common(12):
                print(f"      {n:5d}  {what}")
    import shutil
    import statistics

    shutil.rmtree(work, ignore_errors=True)  # the stores and the Prefect home of this run
    if args.record_line:  # for --versus: the warm calls of the first chunk size, as one JSON line
        import json

        chunk_items = variants[0]
        print(json.dumps({"flow_us": [row[0] for row in per_variant[chunk_items]],
                          "plain_us": PLAIN.get(chunk_items, []),
                          "rows": [row["rows"] for row in ROWS_WRITTEN],
                          "sha256": sorted({row["sha256"] for row in ROWS_WRITTEN}),
                          "load1": os.getloadavg()[0]}))

    print(f"\nwarm calls, {args.groups} groups of {args.group_size} (median over {args.calls - 1} call(s) each)")
    print("chunk_items  chunks  process CPU us/group  groups/s (whole call)  groups/s (pipeline)  s per chunk  "
          "plain us/group  orchestration (flow - plain) / flow, per call")
    for chunk_items, rows in per_variant.items():
        if rows:
            cpu, rate, pipeline = (statistics.median(col) for col in zip(*rows))
            plain = PLAIN.get(chunk_items, [])
            per_call = [1 - p / row[0] for p, row in zip(plain, rows)]  # each flow call against the plain run before it
            shares = ", ".join(f"{100 * share:.0f}%" for share in per_call)
            if len(per_call) > 1:
                shares += f" (median {100 * statistics.median(per_call):.0f}%)"
            print(f"{chunk_items:11d}  {-(-args.groups // chunk_items):6d}  {cpu:20.0f}  {rate:21.1f}  {pipeline:19.1f}"
                  f"  {min(chunk_items, args.groups) / pipeline:11.2f}"
                  f"  {statistics.median(plain) if plain else float('nan'):14.0f}  {shares}")
    if args.cprofile:
        for _, profile in PROFILES:
            profile.disable()
        stream = io.StringIO()
        stats = None
        for kind, profile in PROFILES:
            if args.threads not in kind:
                continue
            try:
                if stats is None:
                    stats = pstats.Stats(profile, stream=stream)
                else:
                    stats.add(profile)
            except TypeError:  # a thread that never ran a profiled call
                pass
        assert stats is not None
        if args.dump:
            stats.dump_stats(args.dump)
        for sort in args.sort.split(","):
            stats.sort_stats(sort).print_stats(args.cprofile)
        print(stream.getvalue())


def prefect_server_process(api_url: str) -> Any:
    """The process listening on the Prefect API's port (psutil.Process), or None when it cannot be found."""
    import psutil
    from urllib.parse import urlparse

    port = urlparse(api_url).port
    for connection in psutil.net_connections("tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port and connection.pid:
            return psutil.Process(connection.pid)
    return None


def process_cpu(process: Any) -> float:
    """User + system CPU seconds of `process` and its children (NaN when unknown)."""
    if process is None:
        return float("nan")
    total = 0.0
    for each in (process, *process.children(recursive=True)):
        times = each.cpu_times()
        total += times.user + times.system
    return total


def asks_ids(checkout: Path) -> bool:
    """Whether CHECKOUT's flow_profile takes --server-token-ids (a checkout from after issue 33's token-id requests):
    then side A asks for ids too, and the A/B compares like with like."""
    own = checkout / "bench" / "datagen" / "flow_profile.py"
    return own.is_file() and "--server-token-ids" in own.read_text(encoding="utf-8")


def versus(args: argparse.Namespace, argv: list[str] | None) -> None:
    """A (`--versus` checkout) and B (this checkout) in alternating child processes against one Prefect server."""
    import json
    import statistics
    import subprocess
    import sys

    from bench.datagen.run import InstantServer, tiny_policy

    here = Path(__file__).resolve().parents[2]
    sides = {"A": args.versus.resolve(), "B": here}
    child_args, skip = [], False
    for arg in (argv if argv is not None else sys.argv[1:]):  # the same options, less --versus/--pairs
        if skip:
            skip = False
        elif arg in ("--versus", "--pairs"):
            skip = True
        elif not arg.startswith(("--versus=", "--pairs=")) and arg != "--server-token-ids":
            child_args.append(arg)
    work = Path(tempfile.mkdtemp(prefix="bench-flowprof-versus-"))
    rounds = []
    calls = 2 if args.smoke else args.calls
    groups_per_call = min(args.groups, 32) if args.smoke else args.groups
    instant = InstantServer(1, tokenizer=tiny_policy()) if args.server_token_ids else InstantServer(1)
    child_args += ["--url", instant.base_url]
    with harness.prefect_server(work / "prefect") as environ, instant:
        server = prefect_server_process(environ["PREFECT_API_URL"])
        for round_index in range(args.pairs):
            got = {}
            for name, checkout in sides.items():
                env = {**os.environ, **environ, "PYTHONPATH": str(checkout)}
                server_cpu = process_cpu(server)
                own = ["--server-token-ids"] if args.server_token_ids and (name == "B" or asks_ids(checkout)) else []
                done = subprocess.run([sys.executable, __file__, *child_args, *own, "--record-line"], env=env,
                                      capture_output=True, text=True, cwd=checkout)
                if done.returncode:
                    raise SystemExit(f"side {name} failed: {done.stderr[-2000:]}")
                time.sleep(2.0)  # the server records the child's last task-run events after the child has exited
                line = next(line for line in reversed(done.stdout.splitlines()) if line.startswith('{"flow_us"'))
                got[name] = json.loads(line)  # the record line; Prefect's log lines may follow it
                got[name]["server_us"] = 1e6 * (process_cpu(server) - server_cpu) / (groups_per_call * calls)
                print(f"round {round_index} side {name}: flow {[round(x) for x in got[name]['flow_us']]} us/group, "
                      f"plain {[round(x) for x in got[name]['plain_us']]}, Prefect server "
                      f"{got[name]['server_us']:.0f} us/group (all {calls} calls), load {got[name]['load1']:.1f}",
                      flush=True)
            rounds.append(got)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    median = statistics.median
    rows = []
    for i, got in enumerate(rounds):
        a, b = got["A"], got["B"]
        cells = [i]
        for side in (a, b):
            flow, plain = median(side["flow_us"]), median(side["plain_us"]) if side["plain_us"] else float("nan")
            cells += [f"{flow:.0f}", f"{plain:.0f}", f"{100 * (1 - plain / flow):.0f}%"]
        same = (a["sha256"] == b["sha256"] and len(a["sha256"]) == 1
                and set(a["rows"]) == set(b["rows"]) == {groups_per_call})
        cells += [f"{a['server_us']:.0f}", f"{b['server_us']:.0f}",
                  f"{median(a['flow_us']) / median(b['flow_us']):.2f}x", "yes" if same else "NO",
                  b["sha256"][0][:16] if b["sha256"] else "-", f"{a['load1']:.1f}/{b['load1']:.1f}"]
        rows.append(cells)
    harness.print_table(["round", "A flow us/group", "A plain", "A orch.", "B flow us/group", "B plain", "B orch.",
                         "A server us/group", "B server us/group", "A/B flow", "same rows", "content sha256",
                          "load A/B"], rows,
                        title=f"warm flow calls, A ({args.versus}) vs B (this checkout), {groups_per_call} groups, "
                              f"A,B interleaved; median of each side's warm calls per round")
    if not all(row[-3] == "yes" for row in rows):
        raise SystemExit("A and B wrote different rows")


if __name__ == "__main__":
    main()
