"""The unit costs behind a datagen flow's orchestration: a task run, a log record, an artifact call, a stats file.

    OMP_NUM_THREADS=1 python -m bench.datagen.prefect_costs --n 300 --rounds 3

One process, one Prefect server (bench.harness). Per round, process CPU (every thread: the engine, Prefect's event
and log workers) of: `--n` task runs of a trivial task submitted and awaited one by one in a flow on the thread
pool (as the datagen flow submits a chunk's rollout task); `--n` INFO records on the flow run's logger (Prefect's
console handler and API log shipping); `--n / 5` (at least 20) progress artifacts created on the run; and, outside Prefect,
`--n` chunk stats files written as the flow writes them (`ShardStore.write_run_file`: temp, fsync, rename) and
without the fsync. Each Prefect part includes 1 s of waiting after it (for the log and event workers to ship what
it queued), so an empty flow's CPU over the same wait is printed and subtracted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench import harness


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    from prefect import flow, get_run_logger, task
    from prefect.cache_policies import NO_CACHE
    from prefect.client.schemas.actions import ArtifactCreate
    from prefect.context import FlowRunContext

    from factory.store import ShardStore

    @task(cache_policy=NO_CACHE, task_run_name="t-{i}")
    def trivial(i: int) -> int:
        return i

    @flow
    def tasks(n: int) -> None:
        for i in range(n):
            trivial.submit(i).result()

    @flow
    def records(n: int) -> None:
        logger = get_run_logger()
        for i in range(n):
            logger.info("progress: toy: %d/100 chunks, %d groups kept (chunk %d: kept 94 groups, dropped {})", i, i, i)

    @flow
    def artifacts(n: int) -> None:
        context = FlowRunContext.get()
        for i in range(n):
            context.client.create_artifact(ArtifactCreate(flow_run_id=context.flow_run.id, type="progress",
                                                          key=f"toy-progress-{i}", data=float(i)))

    @flow
    def empty(n: int) -> None:
        return None

    def cpu_of(fn, n: int) -> float:
        started = time.process_time()
        fn(n)
        time.sleep(1.0)
        return time.process_time() - started

    work = Path(tempfile.mkdtemp(prefix="bench-prefect-costs-"))
    stats = json.dumps({"groups_kept": 94, "rollouts": 752, "dropped": {"equal_scores": 3}, "chunk": 7,
                        "flow_run_id": "0" * 36, "score_sum": 41.5, "worker": {"host": "h", "pid": 1}})
    with harness.prefect_server(work / "prefect"):
        for fn in (tasks, records, artifacts, empty):  # warm-up: imports, engine, clients
            fn(2)
        for round_index in range(args.rounds):
            base = cpu_of(empty, 0)
            task_ms = 1e3 * (cpu_of(tasks, args.n) - base) / args.n
            record_ms = 1e3 * (cpu_of(records, args.n) - base) / args.n
            n_artifacts = max(args.n // 5, 20)
            artifact_ms = 1e3 * (cpu_of(artifacts, n_artifacts) - base) / n_artifacts
            store = ShardStore(work / "store")
            run_dir = store.run_dir("r")
            run_dir.mkdir(parents=True, exist_ok=True)
            started = time.process_time()
            for i in range(args.n):
                store.write_run_file("r", f"stats-p-{i:08d}.json", stats)
            fsynced_ms = 1e3 * (time.process_time() - started) / args.n
            started = time.process_time()
            for i in range(args.n):
                tmp = run_dir / f".stats-q-{i:08d}.json.tmp"
                tmp.write_text(stats, encoding="utf-8")
                os.replace(tmp, run_dir / f"stats-q-{i:08d}.json")
            plain_ms = 1e3 * (time.process_time() - started) / args.n
            print(f"round {round_index} (load {os.getloadavg()[0]:.1f}): empty flow + 1 s {1e3 * base:.0f} ms; "
                  f"per task run {task_ms:.2f} ms, per log record {record_ms:.2f} ms, per artifact {artifact_ms:.2f} "
                  f"ms, per stats file {fsynced_ms:.2f} ms ({plain_ms:.2f} without fsync) of process CPU", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
