"""Where one datagen worker's CPU goes, stage by stage, on the instant server (issue 33).

    python -m bench.datagen.stages --groups 2000 --group-size 8 --chunk-items 500
    python -m bench.datagen.stages --groups 2000 --cprofile 25     # plus cProfile's top functions

The worker is the flow's own plain functions, called in this process's main
thread chunk by chunk exactly as the Prefect tasks call them: `generate_items`
(with the flow's `ClientSampler` over the `InferenceClient`), `score_chunk`
inline, `group_generated`, and `ShardStore.commit` (Arrow build, Parquet write,
fsync, commit log). Each stage is timed in CPU seconds of the thread
(`time.thread_time`), not wall time: the machine this runs on is shared, and a
CPU clock is what a stage costs whatever else runs. Stages:

- request: the inference client's HTTP round trip (httpx, the event loop, JSON
  decoding) = generation's CPU minus the parse and tokenize/mask stages;
- parse: the OpenAI answer -> `Completion`s (factory/inference/parse.py);
- tokenize/mask: the prompt's chat template and the completions' token ids
  (ClientSampler), and the masks/logprobs of each sequence (tasks/group.py);
- score, group, Arrow build, shard write: as named (shard write = the commit
  minus the Arrow build).

`--server-token-ids`: the instant server returns token ids when asked (as
vLLM's `return_token_ids` does) and the worker's client asks (server_type
vllm), so completions and prompts are not tokenized in the worker; without it
(the default) the server returns text only and the worker tokenizes. Both
write the same rows (same content hash).

`--flow` also runs the same groups through the real flow (Prefect server,
task runs, stats files, artifacts) and takes its process CPU per group against
the plain worker's: the difference is the orchestration's share ("Prefect task
overhead"). Results go to bench/results/datagen-profile.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import io
import json
import os
import pstats
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import harness

STAGES = ("request", "parse", "tokenize/mask", "score", "group", "Arrow build", "shard write")


class StageClock:
    """CPU seconds per stage, gathered by wrapping functions (nested stages are subtracted from their callers)."""

    def __init__(self) -> None:
        self.cpu: Counter[str] = Counter()
        self._stack: list[list[float]] = []

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append([0.0])
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - started
                inner = self._stack.pop()[0]
                self.cpu[stage] += spent - inner
                if self._stack:
                    self._stack[-1][0] += spent
        return timed


def patch_stages(clock: StageClock) -> list[tuple[Any, str, Any]]:
    """Wrap the functions of each stage where the worker looks them up; returns what to put back."""
    import factory.inference.client as client
    import factory.schema as schema
    import factory.store as store
    import tasks.generate as generate
    import tasks.group as group
    import tasks.shards as shards

    targets = [
        (client, "parse_chat", "parse"),
        (generate.ClientSampler, "_tokenize", "tokenize/mask"),  # before issue 33: one encode per completion
        (generate.ClientSampler, "_ids", "tokenize/mask"),
        (generate.ClientSampler, "_tokenize_all", "tokenize/mask"),
        (group, "sequence_tokens", "mask"),
        (group, "sequence_arrays", "mask"),  # the columnar group step's masks (issue 33, GroupColumns)
        (store, "groups_to_record_batch", "Arrow build"),
        (shards, "groups_to_record_batch", "Arrow build"),
        (schema, "groups_to_record_batch", "Arrow build"),
    ]
    try:  # a chunk's groups as columns: its Arrow build (checkouts from before have no such module)
        from factory.group_columns import GroupColumns
    except ImportError:
        pass
    else:
        targets.append((GroupColumns, "to_record_batch", "Arrow build"))
    undo = []
    for owner, name, stage in targets:
        original = owner.__dict__.get(name)
        if original is None:
            continue
        undo.append((owner, name, original))
        setattr(owner, name, clock.wrap(stage, original))
    return undo


def plain_worker(base_url: str, groups: int, group_size: int, chunk_items: int, tokenizer: str, store_root: Path,
                 clock: StageClock, server_type: str = "openai") -> dict[str, Any]:
    """The flow's plain functions over `groups` items, chunk by chunk in this thread; returns counts and CPU."""
    from environments.base import EnvSpec, load_env
    from factory.inference.client import InferenceClient, InferenceConfig
    from factory.store import ShardStore
    from flows.datagen import ENVIRONMENTS
    from tasks.generate import ClientSampler, generate_items, load_tokenizer
    from tasks.group import group_generated
    from tasks.score import score_chunk
    from tasks.shards import write_shard

    spec = EnvSpec(ENVIRONMENTS["intern_bootcamp"], {
        "task_name": "arithmetic", "difficulties": [1], "group_size": group_size, "total_items": groups,
        "max_tokens": 16, "tokenizer_name": tokenizer, "ensure_scores_are_not_same": False})
    env = load_env(spec)
    config = InferenceConfig(base_url=base_url, server_type=server_type, model_name="m", num_max_requests_at_once=64)
    tok = load_tokenizer(tokenizer)
    try:  # as generate_chunk does once per worker process, after its environment and tokenizer are loaded
        from factory.datagen.heap import freeze_startup_heap
    except ImportError:  # a checkout from before issue 33's heap freeze (--versus side A)
        pass
    else:
        freeze_startup_heap()
    store, run_id = ShardStore(store_root), "profile"
    score = clock.wrap("score", score_chunk)
    group = clock.wrap("group", group_generated)
    commit = clock.wrap("shard write", write_shard)
    kept = rows = 0

    async def run() -> None:
        nonlocal kept, rows
        async with InferenceClient(config) as client:
            sampler = ClientSampler(client, tok, "chat")
            for chunk, start in enumerate(range(0, groups, chunk_items)):
                items = [env.get_item(i) for i in range(start, min(start + chunk_items, groups))]
                cpu = time.thread_time()
                generated = await generate_items(env, items, sampler, max_in_flight=64)
                clock.cpu["generate (all)"] += time.thread_time() - cpu
                score(spec, generated.items, generated.rollouts, mode="inline")
                grouped = group(env.name, generated, group_size=group_size, max_token_length=2048,
                                ensure_scores_are_not_same=False, run_id=run_id)
                rows += commit(str(store_root), run_id, "profile", chunk, grouped).rows
                kept += len(grouped.groups)

    cpu, wall = time.process_time(), time.perf_counter()
    asyncio.run(run())
    return {"groups": groups, "kept": kept, "rows": rows, "process_cpu_s": time.process_time() - cpu,
            "wall_s": time.perf_counter() - wall, "content_sha256": content_hash(store, run_id)}


def content_hash(store: Any, run_id: str) -> str:
    """SHA-256 of the rows written, in group_id order, without `created_at` (the one column a rerun changes)."""
    import hashlib

    import pyarrow.compute as pc

    table = store.dataset(run_id).to_table()
    table = table.drop_columns(["created_at"]).take(pc.sort_indices(table["group_id"]))
    return hashlib.sha256(json.dumps(table.to_pylist(), sort_keys=True).encode()).hexdigest()


def shares(clock: StageClock) -> dict[str, float]:
    """CPU seconds per stage; `request` is generation's CPU less the parse and tokenize stages inside it."""
    cpu = dict(clock.cpu)
    inside = cpu.get("parse", 0.0) + cpu.get("tokenize/mask", 0.0)  # both run inside generation
    cpu["request"] = max(0.0, cpu.pop("generate (all)", 0.0) - inside)
    cpu["tokenize/mask"] = cpu.get("tokenize/mask", 0.0) + cpu.pop("mask", 0.0)  # masks are built in the group step
    return {stage: cpu.get(stage, 0.0) for stage in STAGES}


def flow_cpu(base_url: str, groups: int, group_size: int, chunk_items: int, tokenizer: str, store: Path,
             server_type: str = "openai") -> float:
    """Process CPU seconds of one whole flow call over the same groups (Prefect server in its own process)."""
    from flows.datagen import intern_bootcamp_datagen

    cpu = time.process_time()
    intern_bootcamp_datagen(
        env={"task_name": "arithmetic", "difficulties": [1], "group_size": group_size, "total_items": groups,
             "max_tokens": 16, "tokenizer_name": tokenizer, "ensure_scores_are_not_same": False},
        openai={"base_url": base_url, "server_type": server_type, "model_name": "m", "num_max_requests_at_once": 64},
        datagen={"store_root": str(store), "run_id": f"profile-flow-{time.time_ns()}", "chunk_items": chunk_items,
                 "max_in_flight": 64, "score_mode": "inline"},
    )
    return time.process_time() - cpu


def profile(base_url: str, args: argparse.Namespace, work: Path, tokenizer: str) -> dict[str, Any]:
    clock = StageClock()
    undo = patch_stages(clock)
    profiler = cProfile.Profile() if args.cprofile else None
    try:
        if profiler is not None:
            profiler.enable()
        worker = plain_worker(base_url, args.groups, args.group_size, args.chunk_items, tokenizer, work / "plain",
                              clock, server_type(args))
        if profiler is not None:
            profiler.disable()
    finally:
        for owner, name, original in undo:
            setattr(owner, name, original)
    stages = shares(clock)
    result: dict[str, Any] = {"worker": worker, "stage_cpu_s": stages}
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.cprofile)
        result["cprofile"] = text.getvalue()
    return result


def server_type(args: argparse.Namespace) -> str:
    """The client's server_type: vllm asks chat servers for token ids (`return_token_ids`), openai does not."""
    return "vllm" if args.server_token_ids else "openai"


def versus(args: argparse.Namespace) -> None:
    """A (another checkout's tasks/ and factory/) and B (this one) in alternating child processes; per round the
    ratio of CPU per group, and the rows written compared by count and content hash. Both sides call one instant
    server started here (with --server-token-ids it returns ids to whichever side asks for them)."""
    import subprocess

    from bench.datagen.run import InstantServer, tiny_policy

    here = Path(__file__).resolve().parents[2]
    sides = {"A": args.versus.resolve(), "B": here}
    rounds = []
    tokenizer = str(tiny_policy())
    server = InstantServer(1, tokenizer=tokenizer if args.server_token_ids else None)
    for round_index in range(args.pairs):
        got = {}
        for name, checkout in sides.items():
            env = {**os.environ, "PYTHONPATH": str(checkout)}
            done = subprocess.run([sys.executable, __file__, "--groups", str(args.groups), "--group-size",
                                   str(args.group_size), "--chunk-items", str(args.chunk_items), "--json-out",
                                   os.devnull, "--record-line", "--url", server.base_url, "--tokenizer", tokenizer,
                                   *(["--server-token-ids"] if args.server_token_ids else [])],
                                  env=env, capture_output=True, text=True, cwd=checkout)
            if done.returncode:
                server.stop()
                raise RuntimeError(f"side {name} failed: {done.stderr[-2000:]}")
            got[name] = json.loads(done.stdout.strip().splitlines()[-1])
        a, b = got["A"], got["B"]
        same = a["worker"]["rows"] == b["worker"]["rows"] and a["worker"]["content_sha256"] == b["worker"]["content_sha256"]
        rounds.append({"round": round_index, "A": a, "B": b, "same_rows": same, "load": os.getloadavg()[0],
                       "cpu_ratio_A_over_B": a["worker"]["process_cpu_s"] / b["worker"]["process_cpu_s"]})
    server.stop()
    rows = []
    for r in rounds:
        rows.append((r["round"], f"{r['A']['worker']['process_cpu_s']:.2f}", f"{r['B']['worker']['process_cpu_s']:.2f}",
                     f"{r['cpu_ratio_A_over_B']:.2f}x", r["B"]["worker"]["rows"],
                     "yes" if r["same_rows"] else "NO", r["B"]["worker"]["content_sha256"][:12], f"{r['load']:.1f}"))
    harness.print_table(["round", "A process CPU s", "B process CPU s", "A/B (B's speed-up)", "rows", "same rows",
                         "content sha256", "load"], rows,
                        title=f"before (A: {args.versus}) / after (B: this checkout), {args.groups} groups of "
                              f"{args.group_size}, A,B interleaved")
    for name in ("A", "B"):
        stages = [r[name]["stage_cpu_s"] for r in rounds]
        total = [sum(s.values()) for s in stages]
        harness.print_table(["stage", "share (median over rounds)", "CPU us/group (median)"],
                            [(stage, f"{100 * sorted(s[stage] / t for s, t in zip(stages, total))[len(stages) // 2]:.1f}%",
                              f"{1e6 * sorted(s[stage] for s in stages)[len(stages) // 2] / args.groups:.0f}")
                             for stage in STAGES], title=f"side {name} by stage")
    with args.json_out.open("a") as out:
        for r in rounds:
            out.write(json.dumps({"bench": "datagen-profile-versus", "time": time.time(),
                                  "command": harness.command_line(), "machine": harness.machine(), **r}) + "\n")
    if not all(r["same_rows"] for r in rounds):
        raise SystemExit("A and B wrote different rows")


def raw_cpu(base_url: str, groups: int, group_size: int) -> float:
    """Process CPU seconds of bench/datagen/raw_client.py (sockets, one process) making `groups` calls, from
    its children's rusage: interpreter start and 64 warm connections included."""
    import resource
    import subprocess

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, str(Path(__file__).with_name("raw_client.py")), "--url", base_url, "--kind",
                    "sockets", "--procs", "1", "--groups", str(groups), "--group-size", str(group_size)],
                   check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def versus_raw(args: argparse.Namespace) -> None:
    """The plain worker (this checkout, its own process) against the raw sockets client, in CPU per group,
    interleaved per round: raw at `--groups` and at 0 groups (its start-up), then the worker."""
    import subprocess

    from bench.datagen.run import InstantServer, tiny_policy

    here = Path(__file__).resolve().parents[2]
    tokenizer = str(tiny_policy())
    rounds = []
    for round_index in range(args.pairs):
        # The raw client asks for no ids (the cheaper answer: the stricter limit); with --server-token-ids the
        # worker asks the same server for them.
        with InstantServer(1, tokenizer=tokenizer if args.server_token_ids else None) as server:
            raw = raw_cpu(server.base_url, args.groups, args.group_size)
            raw_start = raw_cpu(server.base_url, 0, args.group_size)
            done = subprocess.run([sys.executable, __file__, "--groups", str(args.groups), "--group-size",
                                   str(args.group_size), "--chunk-items", str(args.chunk_items), "--json-out",
                                   os.devnull, "--record-line", "--url", server.base_url, "--tokenizer", tokenizer,
                                   *(["--server-token-ids"] if args.server_token_ids else [])],
                                  env={**os.environ, "PYTHONPATH": str(here)}, capture_output=True, text=True, cwd=here,
                                  check=True)
        worker = json.loads(done.stdout.strip().splitlines()[-1])
        rounds.append({"round": round_index, "server_token_ids": args.server_token_ids, "raw_cpu_s": raw,
                       "raw_start_cpu_s": raw_start,
                       "worker_cpu_s": worker["worker"]["process_cpu_s"], "stage_cpu_s": worker["stage_cpu_s"],
                       "rows": worker["worker"]["rows"], "content_sha256": worker["worker"]["content_sha256"],
                       "load": os.getloadavg()[0]})
    us = 1e6 / args.groups
    harness.print_table(
        ["round", "raw CPU us/group (start-up incl.)", "raw, less start-up", "worker CPU us/group",
         "raw/worker", "raw less start-up/worker", "rows", "content sha256", "load"],
        [(r["round"], f"{us * r['raw_cpu_s']:.0f}", f"{us * (r['raw_cpu_s'] - r['raw_start_cpu_s']):.0f}",
          f"{us * r['worker_cpu_s']:.0f}", f"{r['raw_cpu_s'] / r['worker_cpu_s']:.2f}x",
          f"{(r['raw_cpu_s'] - r['raw_start_cpu_s']) / r['worker_cpu_s']:.2f}x", r["rows"], r["content_sha256"][:12],
          f"{r['load']:.1f}") for r in rounds],
        title=f"one datagen worker ({'server returns token ids' if args.server_token_ids else 'tokenizes locally'}) "
              f"against the raw sockets client, CPU per group, {args.groups} groups of {args.group_size} "
              f"(target: raw/worker >= 0.25x)")
    with args.json_out.open("a") as out:
        for r in rounds:
            out.write(json.dumps({"bench": "datagen-profile-versus-raw", "time": time.time(),
                                  "command": harness.command_line(), "machine": harness.machine(), **r}) + "\n")


def main(argv: list[str] | None = None) -> None:
    from bench.datagen.run import InstantServer, tiny_policy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--chunk-items", type=int, default=500)
    parser.add_argument("--flow", action="store_true", help="also time the real flow (Prefect) on the same groups")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N", help="print cProfile's top N functions")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes")
    parser.add_argument("--json-out", type=Path, default=harness.RESULTS_DIR / "datagen-profile.jsonl")
    parser.add_argument("--versus", type=Path, metavar="CHECKOUT",
                        help="before/after: run this profile on CHECKOUT's code (A) and this one's (B), interleaved")
    parser.add_argument("--pairs", type=int, default=3, help="A,B rounds for --versus, rounds for --versus-raw")
    parser.add_argument("--versus-raw", action="store_true",
                        help="CPU per group of this checkout's worker against the raw sockets client, interleaved")
    parser.add_argument("--server-token-ids", action="store_true",
                        help="the server returns token ids and the worker asks for them (vLLM's return_token_ids)")
    parser.add_argument("--record-line", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)  # --versus: the parent's instant server
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.versus is not None:
        return versus(args)
    if args.versus_raw:
        return versus_raw(args)
    if args.smoke:
        args.groups, args.chunk_items = min(args.groups, 32), min(args.chunk_items, 16)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="bench-datagen-profile-"))
    tokenizer = args.tokenizer or str(tiny_policy())
    if args.url:
        result = profile(args.url, args, work, tokenizer)
    else:
        with InstantServer(1, tokenizer=tokenizer if args.server_token_ids else None) as server:
            result = profile(server.base_url, args, work, tokenizer)
            if args.flow:
                with harness.prefect_server(work / "prefect"):
                    flow_cpu(server.base_url, min(args.groups, 64), args.group_size, args.chunk_items, tokenizer,
                             work / "warm", server_type(args))  # imports, first task runs
                    result["flow_process_cpu_s"] = flow_cpu(server.base_url, args.groups, args.group_size,
                                                            args.chunk_items, tokenizer, work / "flow",
                                                            server_type(args))
    import shutil

    shutil.rmtree(work, ignore_errors=True)  # the stores of this run (the rows were hashed already)
    stages, worker = result["stage_cpu_s"], result["worker"]
    measured = sum(stages.values())
    rows = [(stage, f"{cpu:.3f}", f"{100 * cpu / measured:.1f}%", f"{1e6 * cpu / args.groups:.0f}")
            for stage, cpu in stages.items()]
    other = worker["process_cpu_s"] - measured
    rows.append(("other (event loop glue, env items, GC, threads)", f"{other:.3f}",
                 f"{100 * other / worker['process_cpu_s']:.1f}% of process", f"{1e6 * other / args.groups:.0f}"))
    title = (f"one datagen worker's CPU by stage, {args.groups} groups of {args.group_size}, chunks of "
             f"{args.chunk_items} (CPU seconds of the worker thread; the machine is shared, read the shares)")
    if "flow_process_cpu_s" in result:
        flow = result["flow_process_cpu_s"]
        rows.append(("Prefect task overhead (flow process CPU - plain worker's)", f"{flow - worker['process_cpu_s']:.3f}",
                     f"{100 * (flow - worker['process_cpu_s']) / flow:.1f}% of the flow",
                     f"{1e6 * (flow - worker['process_cpu_s']) / args.groups:.0f}"))
    harness.print_table(["stage", "CPU s", "share", "CPU us/group"], rows, title=title)
    print(f"\nplain worker: {worker['groups']} groups, {worker['rows']} rows written, process CPU "
          f"{worker['process_cpu_s']:.2f} s ({args.groups / worker['process_cpu_s']:.0f} groups per CPU second), "
          f"wall {worker['wall_s']:.2f} s; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if "cprofile" in result:
        print(result["cprofile"])
    record = {"bench": "datagen-profile", "time": time.time(), "command": harness.command_line(),
              "machine": harness.machine(), "groups": args.groups, "group_size": args.group_size,
              "chunk_items": args.chunk_items, "server_token_ids": args.server_token_ids, "stage_cpu_s": stages,
              "worker": worker,
              "flow_process_cpu_s": result.get("flow_process_cpu_s")}
    if args.record_line:
        print(json.dumps(record))
    elif not args.smoke:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        with args.json_out.open("a") as out:
            out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    sys.exit(main())
