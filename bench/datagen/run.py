"""Datagen throughput: the factory's flow vs the raw client limit vs Atropos's `process` mode, then end to end on CPU.

    ATROPOS_VENV=/work/.venv-atropos python -m bench.datagen.run --groups 2000 --group-size 8
    python -m bench.datagen.run --smoke          # seconds: every side once, tiny sizes, no end-to-end part

1. The raw limit. The instant OpenAI-compatible server (instant_server.py) and
   the plain client (raw_client.py: hand-written HTTP on sockets, aiohttp with
   a tuned connector, httpx with small pools; 1 or 2 processes) are probed in
   every combination; the fastest client in one process (the flow is one
   worker process) is the raw limit, and every side below calls that server.
2. Side by side in interleaved rounds (bench/harness.py): the raw limit; the
   factory's intern-bootcamp-datagen flow on the `arithmetic` family (real
   Prefect server; tokenization, scoring, grouping and Parquet commits
   included), with inline scoring and with scorer processes; atroposlib 0.4.0's
   `process` mode on the same environment (its venv, one group at a time as
   that mode runs; the same tokenization work as ours; its HTML report timed
   apart). Ratios are to the raw limit within each round; each flow side is
   called once before the rounds (a worker's start-up is not its rate).
   With `--server-token-ids` the instant server can also return token ids
   (vLLM's `return_token_ids`) and answer SGLang's `/generate`, and three
   sides are added: the raw client asking for ids, the flow with server_type
   vllm (which asks, so it tokenizes nothing itself), and the flow with
   server_type sglang (the default deployments' path: it templates and
   encodes each prompt, sends the ids to /generate and gets the answers'
   ids back; the raw loop has no such call). The raw limit (baseline) stays
   the client that asks for no ids (the cheaper answer: the stricter limit); the per-round
   table also holds each flow to the raw loop making that flow's own calls
   (asking for ids when the flow does). Atropos's process mode does not ask
   for ids either way, so it tokenizes as before. Every flow call, with ids
   or without, must write the same rows.
3. End to end on the local CPU policy server (starter policy if built, else a
   tiny random one): rollouts/s and the share of wall time in inference.
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

import httpx

from bench import harness
from bench.atropos_venv import atropos_available, atropos_python
from bench.datagen import raw_client
from factory.inference.local_server import free_port

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench" / "out" / "datagen"


STARTED = time.monotonic()


def phase(name: str) -> None:
    print(f"[bench.datagen] {time.monotonic() - STARTED:6.1f}s {name}", file=sys.stderr, flush=True)


def wait_up(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up within {timeout}s")


def tiny_policy() -> Path:
    from factory.inference.tiny_model import make_tiny_policy

    path = OUT / "tiny-policy"
    if not (path / "config.json").is_file():
        make_tiny_policy(path)
    return path


class InstantServer:
    """bench/datagen/instant_server.py in its own process group, `workers` processes on one port."""

    def __init__(self, workers: int, tokenizer: str | Path | None = None) -> None:
        """With `tokenizer`, requests that ask for `return_token_ids` get ids (see instant_server.py)."""
        self.workers, self.port = workers, free_port()
        self.process = subprocess.Popen([sys.executable, "-m", "bench.datagen.instant_server", "--port",
                                         str(self.port), "--workers", str(workers),
                                         *(["--tokenizer", str(tokenizer)] if tokenizer else [])], cwd=REPO)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        wait_up(f"{self.base_url}/models")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)

    def __enter__(self) -> InstantServer:
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()


def probe_raw_limit(groups: int, group_size: int, smoke: bool) -> tuple[list[dict], dict]:
    """Every server-workers x client x processes combination once; returns the rows and the fastest."""
    clients = [("sockets", sys.executable), ("httpx", sys.executable)]
    if atropos_available():  # aiohttp is not a factory dependency; the Atropos venv has it
        clients.insert(1, ("aiohttp", str(atropos_python())))
    rows = []
    for workers in (1,) if smoke else (1, 2):
        server = InstantServer(workers)
        try:
            for kind, python in clients:
                for procs in (1, 2):
                    if smoke and (procs == 2 or kind == "httpx"):
                        continue
                    done = subprocess.run([python, raw_client.__file__, "--url", server.base_url, "--kind", kind,
                                           "--groups", str(groups), "--group-size", str(group_size),
                                           "--procs", str(procs)], capture_output=True, text=True, check=True)
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    rows.append({**result, "server_workers": workers, "python": python})
        finally:
            server.stop()
    return rows, fastest_one_process(rows)


def fastest_one_process(rows: list[dict]) -> dict:
    """The raw limit the flow is held to: the fastest client in ONE process (the flow is one worker process; a
    2-process client row would make the ratio a per-node one). Rows with more processes are printed, not used."""
    return max((row for row in rows if row["procs"] == 1), key=lambda row: row["groups_per_s"])


RAW_MIN_GROUPS = 40_000
"""The raw loop's timed window is at least this many groups: it runs ~15,000-25,000 groups/s, so 1000 groups is a
0.1 s window whose rate swung 8,000-18,700 groups/s between rounds (09:26 UTC, 2026-11-26) and made every ratio to
it noise; 10,000 groups (~0.5 s) still swung 9,400-21,000 in one run (2026-11-28), against a flow pipeline timed
over ~3 s. ~2 s windows: a rate over a longer window of the same calls is the same quantity, measured steadily."""


def raw_side(best: dict, base_url: str, groups: int, group_size: int, token_ids: bool = False) -> float:
    done = subprocess.run([best["python"], raw_client.__file__, "--url", base_url, "--kind", best["kind"],
                           "--groups", str(groups), "--group-size", str(group_size), "--procs", str(best["procs"]),
                           *(["--return-token-ids"] if token_ids else [])],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["groups_per_s"]


ROWS_WRITTEN: list[dict] = []
"""Each factory flow call's rows: side, count and content hash (bench.datagen.stages.content_hash)."""


def factory_flow(base_url: str, groups: int, group_size: int, tokenizer: Path, store: Path, side: str = "",
                 server_type: str = "openai", **datagen) -> dict:
    """One flow call into a fresh store under one run id, so every call's rows can be compared by content hash."""
    from bench.datagen.stages import content_hash
    from factory.store import ShardStore
    from flows.datagen import intern_bootcamp_datagen

    root = store / f"{side or 'flow'}-{time.time_ns()}"
    started, cpu = time.perf_counter(), time.process_time()
    summary = intern_bootcamp_datagen(
        env={"task_name": "arithmetic", "difficulties": [1], "group_size": group_size, "total_items": groups,
             "max_tokens": 16, "tokenizer_name": str(tokenizer), "ensure_scores_are_not_same": False},
        openai={"base_url": base_url, "server_type": server_type, "model_name": "m", "num_max_requests_at_once": 64},
        datagen={"store_root": str(root), "run_id": "bench", "chunk_items": max(groups // 4, 1),
                 "max_in_flight": 64, **datagen},
    )
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    rows_store = ShardStore(root)
    ROWS_WRITTEN.append({"side": side, "rows": rows_store.count("bench"), "sha256": content_hash(rows_store, "bench")})
    return {"groups/s": groups / seconds, "groups/s, pipeline only": summary["session_groups_per_s"] or 0.0,
            "process CPU us/group": 1e6 * cpu / groups}


def atropos_process(python: Path, base_url: str, groups: int, group_size: int, tokenizer: Path, work: Path) -> dict:
    """One `process` run; the loop's rate (setup to the JSONL's close) and the whole process's (report excluded)."""
    out, timing = work / f"atropos-{time.time_ns()}.jsonl", work / f"atropos-{time.time_ns()}.timing.json"
    cmd = [str(python), str(REPO / "bench/datagen/atropos_arith_env.py"), "process",
           "--env.total_steps", str(groups), "--env.group_size", str(group_size), "--env.use_wandb", "false",
           "--env.tokenizer_name", str(tokenizer), "--env.data_path_to_save_groups", str(out),
           "--openai.base_url", base_url, "--openai.model_name", "m", "--openai.api_key", "x"]
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "BENCH_TIMING": str(timing)}
    env.pop("PYTHONPATH", None)
    started = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work)
    ended = time.time()
    if done.returncode != 0 or not timing.is_file():
        raise RuntimeError(f"Atropos process mode failed: {done.stderr[-2000:]}")
    times = json.loads(timing.read_text())
    written = sum(1 for _ in out.open())
    if written != groups:
        raise RuntimeError(f"Atropos wrote {written} groups, expected {groups}")
    report = times["report_end"] - times["loop_end"]
    return {"groups/s, pipeline only": groups / (times["loop_end"] - times["loop_start"]),
            "groups/s, whole process (report excluded)": groups / (ended - started - report)}


def end_to_end(groups: int, group_size: int, store: Path) -> dict:
    from factory.inference.local_server import start_local_server
    from flows.datagen import intern_bootcamp_datagen

    starter = REPO / "models" / "starter-policy"
    model = starter if (starter / "config.json").is_file() else tiny_policy()
    with start_local_server(model) as server:
        summary = intern_bootcamp_datagen(
            env={"group_size": group_size, "total_items": groups, "max_tokens": 24, "tokenizer_name": str(model)},
            openai={"base_url": server.base_url},
            datagen={"store_root": str(store), "run_id": f"e2e-{time.time_ns()}", "chunk_items": max(groups // 4, 1)},
        )
    summary["model"] = model.name
    return summary


INLINE, PROCESSES = "factory flow, inline scoring", "factory flow, scorer processes"
INLINE_IDS, RAW_IDS = "factory flow, inline scoring, server token ids", "raw client asking for token ids"
INLINE_GENERATE = "factory flow, inline scoring, SGLang /generate"
"""The default deployments' path (server_type sglang): the flow templates and encodes each prompt and sends its ids;
the server returns the answers' ids."""


def stage_profile(base_url: str, groups: int, group_size: int, chunk_items: int, tokenizer: Path, work: Path,
                  server_type: str = "openai") -> dict:
    """CPU seconds per stage of one plain worker over the same groups (the flow's functions without Prefect)."""
    from bench.datagen import stages

    clock = stages.StageClock()
    undo = stages.patch_stages(clock)
    try:
        worker = stages.plain_worker(base_url, groups, group_size, chunk_items, str(tokenizer),
                                     work / f"stages-{time.time_ns()}", clock, server_type)
    finally:
        for owner, name, original in undo:
            setattr(owner, name, original)
    return {"stages": stages.shares(clock), "process_cpu_s": worker["process_cpu_s"]}


def print_stages(stage_cpu: dict, result: harness.Comparison, groups: int, flow_side: str = INLINE,
                 title: str = "") -> None:
    """Each stage's share of a worker's CPU, and what the flow adds on top (Prefect tasks, stats, artifacts)."""
    from bench.datagen.stages import STAGES

    cpu = stage_cpu["stages"]
    total = sum(cpu.values())
    rows = [(stage, f"{100 * cpu[stage] / total:.1f}%", f"{1e6 * cpu[stage] / groups:.0f}") for stage in STAGES]
    plain = 1e6 * stage_cpu["process_cpu_s"] / groups
    # The stage clocks (two thread_time calls per timed call, ~10 per group) make this plain worker dearer than an
    # untimed one, so plain vs flow here is no orchestration figure: bench.datagen.cpu_owners (py-spy) and
    # flow_profile --plain (untimed plain worker, same process) measure that.
    rows.append(("whole plain worker, timed per stage (process CPU)", "", f"{plain:.0f}"))
    flow = result.median(flow_side, "process CPU us/group")
    rows.append(("flow, inline scoring (process CPU, median)", "", f"{flow:.0f}"))
    harness.print_table(["stage", "share", "CPU us/group"], rows,
                        title=f"one worker's CPU by stage{title} (bench.datagen.stages; orchestration: "
                              "bench.datagen.cpu_owners)")


def print_rows_written(groups: int) -> bool:
    """Every factory flow call wrote the same rows: `groups` of them, one content hash."""
    hashes = {row["sha256"] for row in ROWS_WRITTEN}
    ok = len(hashes) == 1 and all(row["rows"] == groups for row in ROWS_WRITTEN)
    harness.print_table(["side", "calls", "rows each", "content sha256"],
                        [(side, sum(1 for r in ROWS_WRITTEN if r["side"] == side),
                          ",".join(sorted({str(r["rows"]) for r in ROWS_WRITTEN if r["side"] == side})),
                          ",".join(sorted({r["sha256"][:16] for r in ROWS_WRITTEN if r["side"] == side})))
                         for side in dict.fromkeys(r["side"] for r in ROWS_WRITTEN)],
                        title=f"rows written by the flow ({'same' if ok else 'DIFFERENT'} count and content in every call)")
    return ok


def print_rounds(result: harness.Comparison) -> None:
    """The issue's ratios round by round: the flow (inline scoring) to the raw loop and to Atropos's process mode."""
    atropos = "atroposlib 0.4.0 process mode"
    have_atropos = atropos in result.sides
    flows = [side for side in (INLINE, INLINE_IDS, INLINE_GENERATE) if side in result.sides]
    tokens = {INLINE: "no ids", INLINE_IDS: "server ids", INLINE_GENERATE: "/generate (ids both ways)"}
    rows = []
    for i, raw in enumerate(result.values[result.baseline]["groups/s"]):
        for side in flows:
            flow, pipeline = (result.values[side][m][i] for m in ("groups/s", "groups/s, pipeline only"))
            # The raw loop making this flow's own calls: with ids asked, the answers carry them (bigger bodies).
            # The raw loop has no /generate calls (it cannot tokenize a prompt): that row has no same-calls ratio.
            same = result.values[RAW_IDS]["groups/s"][i] if side == INLINE_IDS else raw if side == INLINE else None
            row = [i, tokens[side], f"{raw:.0f}", f"{flow:.0f}", f"{flow / raw:.3f}x", f"{pipeline:.0f}",
                   f"{pipeline / raw:.3f}x",
                   *(("-", "-") if same is None else (f"{same:.0f}", f"{pipeline / same:.3f}x"))]
            if have_atropos:
                theirs = result.values[atropos]["groups/s, pipeline only"][i]
                whole = result.values[atropos]["groups/s, whole process (report excluded)"][i]
                row += [f"{theirs:.1f}", f"{pipeline / theirs:.2f}x", f"{flow / whole:.2f}x"]
            rows.append(row)
    harness.print_table(["round", "flow tokens", "raw groups/s", "flow groups/s (whole call)", "flow/raw",
                         "flow pipeline groups/s", "pipeline/raw", "raw groups/s, same calls",
                         "pipeline/raw, same calls",
                         *(["Atropos loop groups/s", "flow pipeline/Atropos loop",
                            "flow whole call/Atropos whole process"] if have_atropos else [])],
                        rows, title="per round: factory flow (inline scoring) vs the raw loop (1 process, no ids "
                                    "asked; and making the flow's own calls) and Atropos (no ids asked)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--e2e-groups", type=int, default=None,
                        help="problems for the end-to-end part (default 64; 0 skips it, as --smoke does)")
    parser.add_argument("--skip-atropos", action="store_true", help="leave out atroposlib's process mode")
    parser.add_argument("--server-token-ids", action="store_true",
                        help="add the raw client and the flow asking the server for token ids (vLLM's "
                             "return_token_ids), and the flow on SGLang's /generate")
    harness.add_bench_args(parser)
    args = parser.parse_args(argv)
    if args.e2e_groups is None:
        args.e2e_groups = 0 if args.smoke else 64  # the policy server's start is most of a smoke run's time
    if args.smoke:
        args.groups = min(args.groups, 16)
    pairs, json_out = harness.pairs_from(args), harness.json_path("datagen", args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-datagen-"))
    atropos = None
    if not args.skip_atropos:
        if atropos_available() or not args.smoke:
            atropos = atropos_python()
        else:
            print("[bench] no Atropos venv (bench/atropos_venv.py); smoke run leaves that side out", file=sys.stderr)

    phase("probing the raw limit")
    probe_rows, best = probe_raw_limit(max(args.groups, 200 if args.smoke else 2000), args.group_size, args.smoke)
    phase("Prefect server")
    tokenizer = tiny_policy()
    try:
        with harness.prefect_server(work / "prefect"), InstantServer(
                best["server_workers"], tokenizer=tokenizer if args.server_token_ids else None) as server:
            g, n, url = args.groups, args.group_size, server.base_url
            raw_groups = g if args.smoke else max(g, RAW_MIN_GROUPS)
            sides = [harness.Side(f"raw limit ({best['kind']}, {best['procs']} proc)",
                                  lambda: raw_side(best, url, raw_groups, n)),
                     harness.Side(INLINE, lambda: factory_flow(url, g, n, tokenizer, work / "store", "inline",
                                                               score_mode="inline")),
                     harness.Side(PROCESSES, lambda: factory_flow(url, g, n, tokenizer, work / "store", "processes",
                                                                  score_mode="process"))]
            if args.server_token_ids:
                sides[1:1] = [harness.Side(RAW_IDS, lambda: raw_side(best, url, raw_groups, n, token_ids=True))]
                sides.insert(3, harness.Side(INLINE_IDS, lambda: factory_flow(
                    url, g, n, tokenizer, work / "store", "inline, ids", server_type="vllm", score_mode="inline")))
                sides.insert(4, harness.Side(INLINE_GENERATE, lambda: factory_flow(
                    url, g, n, tokenizer, work / "store", "inline, /generate", server_type="sglang",
                    score_mode="inline")))
            if atropos is not None:
                sides.append(harness.Side("atroposlib 0.4.0 process mode",
                                          lambda: atropos_process(atropos, url, g, n, tokenizer, work)))
            phase("warm-up: one call of each flow and raw side (imports, tokenizer, Prefect engine, the server's "
                  "answers), not timed")
            for side in sides:  # a datagen worker is long-lived: round 0 would otherwise time its start-up; the raw
                if not side.name.startswith("atroposlib"):  # loop is warmed too, so neither gets a warm-up alone
                    side.run()
            ROWS_WRITTEN.clear()
            phase(f"{pairs} interleaved round(s) of {len(sides)} sides")
            result = harness.compare("datagen", sides, pairs=pairs, metric="groups/s", json_out=json_out,
                                     label=f"{g} groups of {n}, instant server x{best['server_workers']}")
            phase("stage profile of one worker (bench.datagen.stages)")
            stage_cpu = stage_profile(url, g, n, max(g // 4, 1), tokenizer, work)
            if args.server_token_ids:
                stage_ids = stage_profile(url, g, n, max(g // 4, 1), tokenizer, work, server_type="vllm")
            if args.e2e_groups:
                phase("end to end on the local policy server")
                e2e = end_to_end(args.e2e_groups, args.group_size, work / "store")
    finally:  # the stores, Atropos's files and the Prefect home (the rows were hashed already)
        shutil.rmtree(work, ignore_errors=True)
    phase("done")

    harness.print_table(["server workers", "client", "processes", "groups/s"],
                        [(r["server_workers"], r["kind"], r["procs"], r["groups_per_s"]) for r in probe_rows],
                        title=f"raw limit probe ({probe_rows[0]['groups']} groups of {args.group_size}, 64 "
                              "connections per process)")
    harness.print_comparison(result, title=f"datagen throughput, {args.groups} groups of {args.group_size}, "
                                           f"instant server with {best['server_workers']} worker(s)",
                             json_out=json_out)
    print_stages(stage_cpu, result, g, title=", server returns no ids")
    if args.server_token_ids:
        print_stages(stage_ids, result, g, INLINE_IDS, title=", server returns token ids")
    rows_ok = print_rows_written(g)
    atropos_side = "atroposlib 0.4.0 process mode"
    if atropos_side in result.sides:
        metric = "groups/s, pipeline only"
        rows = []
        for side in (side for side in (INLINE, INLINE_IDS, INLINE_GENERATE, PROCESSES) if side in result.sides):
            low, high = result.spread(side, metric, versus=atropos_side)
            rows.append((side, f"{result.median_ratio(side, metric, versus=atropos_side):.2f}x", f"{low:.2f}-{high:.2f}x"))
        harness.print_table(["side (pipeline only)", "vs Atropos process mode (median)", "min-max"], rows,
                            title="factory vs Atropos, same rounds")
    print_rounds(result)
    if not rows_ok:
        raise SystemExit("the factory flow's calls wrote different rows (count or content hash); see above")
    if not args.e2e_groups:
        return
    harness.print_table(["model", "problems", "rollouts/s", "completion tokens/s", "inference share", "kept",
                         "dropped"],
                        [(e2e["model"], args.e2e_groups, e2e["session_rollouts_per_s"], e2e["session_tokens_per_s"],
                          e2e["inference_share"], e2e["groups_kept"], sum(e2e["dropped"].values()))],
                        title=f"end to end on the local CPU policy server ({args.group_size} per problem)")


if __name__ == "__main__":
    main()
