"""Instructions per group of one datagen worker, counted by callgrind: a CPU measure that does not move with load.

    python -m bench.datagen.instructions --versus /path/to/other/checkout    # A = that checkout, B = this one
    python -m bench.datagen.instructions --smoke                              # this checkout against itself

On this shared 2-core machine a timed A/B of the worker moves 10-20% from call to call, and the same code in
both sides of an interleaved pair gave 0.93x (issue 33, 2026-11-28): changes worth 1-5% cannot be seen in time.
Instructions executed are deterministic (two runs of one checkout agree to 0.2%). They do not weigh a cache miss
or a copy like time does (a garbage collector's pass over scattered objects, `memcpy` of large buffers), so a
change that moves memory rather than instructions still needs a timed A/B; for Python-level work they are the
measure that can see a few percent.

Each side runs the flow's plain functions in one process under `valgrind --tool=callgrind --instr-atstart=no`,
as `bench.datagen.stages` does: items drawn by the environment, `generate_items` with the flow's `ClientSampler`
over the `InferenceClient` (the instant server returns token ids, vLLM's `return_token_ids`), `score_chunk`
inline, `group_generated`, and `write_shard` (Arrow, Parquet, fsync, commit log). One chunk runs first,
uncounted (imports, tokenizer, first connections); counting is switched on for the next `--groups` groups only.
The instant server runs outside valgrind. The loop is this file's own rather than `stages.plain_worker` (which
also hashes the rows it wrote, and differs between checkouts): both sides run this checkout's driver over their own
environments/, tasks/ and factory/ code, so only that code differs between A and B. Needs valgrind (Debian's
`valgrind` package); results go to bench/results/datagen-instructions.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def worker(args: argparse.Namespace) -> None:
    """Inside valgrind: one uncounted chunk, then `--groups` counted groups; prints the groups kept."""
    sys.path.insert(0, str(args.checkout))
    import asyncio

    from environments.base import EnvSpec, load_env
    from factory.inference.client import InferenceClient, InferenceConfig
    from flows.datagen import ENVIRONMENTS
    from tasks.generate import ClientSampler, generate_items, load_tokenizer
    from tasks.group import group_generated
    from tasks.score import score_chunk
    from tasks.shards import write_shard

    try:
        from factory.datagen.heap import freeze_startup_heap
    except ImportError:  # a checkout from before the worker froze its start-up heap
        freeze_startup_heap = None  # type: ignore[assignment]
    chunk_items = args.chunk_items
    spec = EnvSpec(ENVIRONMENTS["intern_bootcamp"], {
        "task_name": "arithmetic", "difficulties": [1], "group_size": args.group_size, "total_items": 10**9,
        "max_tokens": 16, "tokenizer_name": args.tokenizer, "ensure_scores_are_not_same": False})
    env = load_env(spec)
    tokenizer = load_tokenizer(args.tokenizer)
    if freeze_startup_heap is not None:
        freeze_startup_heap()
    store = str(args.store)
    kept = 0

    def counting(on: bool) -> None:
        subprocess.run(["callgrind_control", "--instr=on" if on else "--instr=off", str(os.getpid())], check=True,
                       capture_output=True)

    async def run() -> None:
        nonlocal kept
        config = InferenceConfig(base_url=args.url, server_type="vllm", model_name="m", num_max_requests_at_once=64,
                                 timeout=600)
        async with InferenceClient(config) as client:
            sampler = ClientSampler(client, tokenizer, "chat")
            chunk = 0
            for counted, groups in ((False, chunk_items), (True, args.groups)):
                if counted:
                    counting(True)
                for start in range(0, groups, chunk_items):
                    first = chunk * chunk_items
                    items = [env.get_item(i) for i in range(first, first + min(chunk_items, groups - start))]
                    generated = await generate_items(env, items, sampler, max_in_flight=64)
                    score_chunk(spec, generated.items, generated.rollouts, mode="inline")
                    grouped = group_generated(env.name, generated, group_size=args.group_size,
                                              max_token_length=2048, ensure_scores_are_not_same=False, run_id="ir")
                    write_shard(store, "ir", "instructions", chunk, grouped)
                    if counted:
                        kept += len(grouped.groups)
                    chunk += 1
                if counted:
                    counting(False)

    asyncio.run(run())
    print(json.dumps({"kept": kept}))


def count(checkout: Path, url: str, tokenizer: str, groups: int, group_size: int, chunk_items: int) -> dict[str, Any]:
    """One side: the worker under callgrind; instructions per counted group and the rows written."""
    work = Path(tempfile.mkdtemp(prefix="bench-instructions-"))
    try:
        out = work / "callgrind.out"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0",
               "PYTHONPATH": str(checkout)}
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", sys.executable,
             __file__, "--worker", "--checkout", str(checkout), "--url", url, "--tokenizer", tokenizer,
             "--groups", str(groups), "--group-size", str(group_size), "--chunk-items", str(chunk_items),
             "--store", str(work / "store")],
            cwd=checkout, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the worker under callgrind failed ({checkout}):\n{done.stderr[-3000:]}")
        written = json.loads(done.stdout.strip().splitlines()[-1])
        instructions = 0
        for part in work.glob("callgrind.out*"):  # one file per dump; its "totals:" line (its "summary:" may be 0)
            for line in part.read_text(errors="replace").splitlines():
                if line.startswith("totals:"):
                    instructions += int(line.split()[1])
        return {"checkout": str(checkout), "groups": groups, "kept": written["kept"],
                "instructions_per_group": instructions / groups}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def worker_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for name in ("--url", "--tokenizer", "--store"):
        parser.add_argument(name, required=True)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--checkout", type=Path, required=True)
    for name in ("--groups", "--group-size", "--chunk-items"):
        parser.add_argument(name, type=int, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:  # inside valgrind: nothing of this checkout is imported before the side's own code
        return worker(worker_args(argv))
    sys.path.insert(0, str(REPO))
    from bench import harness

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versus", type=Path, metavar="CHECKOUT", help="side A (default: this checkout, a self-check)")
    parser.add_argument("--groups", type=int, default=3000, help="counted groups per side")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--chunk-items", type=int, default=3000, help="the flow bench's chunk (groups/4 of 12,000)")
    harness.add_bench_args(parser, pairs=1)  # --smoke: 100 counted groups in chunks of 50; one A,B round is
    # enough by default (the counts repeat to ~0.2%); results: bench/results/datagen-instructions.jsonl
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("bench.datagen.instructions needs valgrind (Debian: apt-get install valgrind)")
    if args.smoke:
        args.groups, args.chunk_items = 100, 50
    pairs, json_out = harness.pairs_from(args), harness.json_path("datagen-instructions", args)
    from bench.datagen.run import InstantServer, tiny_policy

    tokenizer = str(tiny_policy())
    sides = [("A", (args.versus or REPO).resolve()), ("B", REPO)]
    rows: list[dict[str, Any]] = []
    with InstantServer(1, tokenizer=tokenizer) as server:
        for round_number in range(pairs):
            for name, checkout in sides:
                row = count(checkout, server.base_url, tokenizer, args.groups, args.group_size, args.chunk_items)
                rows.append({"round": round_number, "side": name, **row})
                print(f"[bench.instructions] round {round_number} side {name}: "
                      f"{row['instructions_per_group']:,.0f} instructions/group", file=sys.stderr)
    print(f"\n## instructions per datagen group (callgrind), {args.groups} counted groups of {args.group_size}, "
          f"chunks of {args.chunk_items}\n")
    print("| round | A instructions/group | B instructions/group | B/A | groups kept (A, B) |")
    print("|---:|---:|---:|---:|---|")
    for round_number in range(pairs):
        a, b = (next(r for r in rows if r["round"] == round_number and r["side"] == s) for s in ("A", "B"))
        print(f"| {round_number} | {a['instructions_per_group']:,.0f} | {b['instructions_per_group']:,.0f} | "
              f"{b['instructions_per_group'] / a['instructions_per_group']:.4f} | {a['kept']}, {b['kept']} |")
    print(f"\nA: {sides[0][1]}\nB: {sides[1][1]}")
    json_out.parent.mkdir(parents=True, exist_ok=True)
    with json_out.open("a") as handle:
        for row in rows:
            handle.write(json.dumps({"bench": "datagen-instructions", "at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                          time.gmtime()),
                                     "smoke": args.smoke, **row}) + "\n")


if __name__ == "__main__":
    main()
