"""Datagen throughput: the factory's flow vs the raw client limit vs Atropos's `process` mode, then end to end on CPU.

    ATROPOS_VENV=/opt/atropos-venv python -m bench.datagen.run --groups 2000 --group-size 8

1. Against an instant OpenAI-compatible server (bench/datagen/instant_server.py),
   the same calls three ways: a plain `AsyncOpenAI` loop (one chat call with
   n=group_size per group, 64 in flight: the raw limit), the factory's
   intern-bootcamp-datagen flow on the `arithmetic` family (real Prefect server,
   tokenization, scoring, grouping and Parquet shards included), and
   atroposlib 0.4.0's `process` mode on the same environment (its own venv; its
   start-up time, measured with a 1-group run, is subtracted).
2. Against the local CPU policy server (starter policy if present, else a tiny
   random one): end-to-end rollouts/s and the share of wall time in inference.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench" / "out" / "datagen"


def free_port() -> int:
    from factory.inference.local_server import _free_port

    return _free_port()


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


async def raw_loop(base_url: str, groups: int, group_size: int, concurrency: int = 64) -> float:
    import openai

    sdk = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0,
                             http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 8)))
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            await sdk.chat.completions.create(
                model="m", n=group_size, max_tokens=16,
                messages=[{"role": "user", "content": f"Compute {10 + i % 90}+{20 + i % 70}. Put the answer in <answer></answer>."}])

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(groups)))
    elapsed = time.perf_counter() - started
    await sdk.close()
    return groups / elapsed


def factory_flow(base_url: str, groups: int, group_size: int, tokenizer: Path, store: Path, **datagen) -> tuple[float, dict]:
    from flows.datagen import intern_bootcamp_datagen

    run_id = f"bench-{int(time.time() * 1000)}"
    started = time.perf_counter()
    summary = intern_bootcamp_datagen(
        env={"task_name": "arithmetic", "difficulties": [1], "group_size": group_size, "total_items": groups,
             "max_tokens": 16, "tokenizer_name": str(tokenizer), "ensure_scores_are_not_same": False},
        openai={"base_url": base_url, "server_type": "openai", "model_name": "m", "num_max_requests_at_once": 64},
        datagen={"store_root": str(store), "run_id": run_id, "chunk_items": max(groups // 4, 1), "max_in_flight": 64,
                 **datagen},
    )
    return groups / (time.perf_counter() - started), summary


def atropos_process(base_url: str, groups: int, group_size: int, tokenizer: Path, work: Path) -> float | None:
    sys.path.insert(0, str(REPO))
    from bench.atropos_venv import atropos_python

    try:
        python = atropos_python()
    except (subprocess.CalledProcessError, OSError) as error:
        print(f"[bench] Atropos venv unavailable ({error}); skipping the Atropos column", file=sys.stderr)
        return None

    def run(steps: int) -> float:
        out = work / f"atropos-{steps}-{time.time_ns()}.jsonl"
        cmd = [str(python), str(REPO / "bench/datagen/atropos_arith_env.py"), "process",
               "--env.total_steps", str(steps), "--env.group_size", str(group_size), "--env.use_wandb", "false",
               "--env.tokenizer_name", str(tokenizer), "--env.data_path_to_save_groups", str(out),
               "--openai.base_url", base_url, "--openai.model_name", "m", "--openai.api_key", "x"]
        started = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
        elapsed = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"Atropos process mode failed: {done.stderr[-2000:]}")
        return elapsed

    startup = run(1)
    total = run(groups + 1)
    return groups / max(total - startup, 1e-6)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--e2e-groups", type=int, default=64)
    parser.add_argument("--skip-atropos", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-datagen-"))

    from factory.local_prefect import LocalPrefect

    stack = LocalPrefect(home=work / "prefect", port=free_port())
    stack.up(worker=False)
    os.environ.update(stack.environ())
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "bench.datagen.instant_server", "--port", str(port)], cwd=REPO)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_up(f"{base_url}/models")
        tokenizer = tiny_policy()
        raw = asyncio.run(raw_loop(base_url, args.groups, args.group_size))
        flow_rate, summary = factory_flow(base_url, args.groups, args.group_size, tokenizer, work / "store")
        process_rate, process_summary = factory_flow(base_url, args.groups, args.group_size, tokenizer, work / "store",
                                                     score_mode="process")
        atropos = None if args.skip_atropos else atropos_process(base_url, args.groups, args.group_size, tokenizer, work)
        e2e = end_to_end(args.e2e_groups, args.group_size, work / "store")
    finally:
        server.terminate()
        server.wait()
        stack.down()

    print(f"\n## datagen throughput, {args.groups} groups of {args.group_size}, instant OpenAI-compatible server")
    print(f"{'path':58} {'groups/s':>9} {'vs raw':>7}")
    rows = [("plain AsyncOpenAI loop (raw limit, 64 in flight)", raw),
            ("factory flow, whole flow call (default: inline scoring)", flow_rate),
            ("factory flow, pipeline only (summary's session rate)", summary["session_groups_per_s"] or 0.0),
            ("factory flow, whole call, scorer processes (incl. start)", process_rate),
            ("factory flow, pipeline only, scorer processes", process_summary["session_groups_per_s"] or 0.0)]
    if atropos is not None:
        rows.append(("Atropos 0.4.0 process mode (start-up subtracted)", atropos))
    for name, rate in rows:
        print(f"{name:58} {rate:9.1f} {rate / raw:7.2f}")
    print(f"\n## end to end on the local CPU policy server ({e2e['model']}, {args.e2e_groups} problems x {args.group_size})")
    print(f"rollouts/s {e2e['session_rollouts_per_s']}, completion tokens/s {e2e['session_tokens_per_s']}, "
          f"share of wall time in inference {e2e['inference_share']}, groups kept {e2e['groups_kept']}, "
          f"dropped {e2e['dropped']}")


if __name__ == "__main__":
    main()
