"""The shard store on an object store vs on local disk: run-api start-up, follow latency, a warm follower poll,
export and compaction, before and after compaction, on a local moto S3 server this bench starts and stops.

    OMP_NUM_THREADS=1 python -m bench.shards.object_store --shards 500 --rounds 2
    python -m bench.shards.object_store --smoke      # 40 shards, 1 round

moto is a single-threaded Python server on this machine: its request cost (~ms per request) stands in for the
round trip to a real S3-compatible server, so read the s3 column as "cost in requests", not as S3's speed.
Each round measures local then s3 on stores of the same shards (synthetic, 10 groups of 4 x 64 tokens each).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench.local_s3 import start_local_s3
import factory.serve.follower  # noqa: F401 - imported before any timing (run-api imports them on first use)
import factory.serve.ingest  # noqa: F401
import factory.serve.payload  # noqa: F401
from factory.serve.config import ServeConfig
from factory.serve.service import BatchService
from factory.store import ShardStore
from factory.store_object import open_store
from factory.store_object_compact import compact_store_run
from factory.synthetic import synthetic_groups

REGISTRATION = dict(wandb_group="g", wandb_project="p", batch_size=8, max_token_len=64, checkpoint_dir="ckpt",
                    save_checkpoint_interval=5, starting_step=0, num_steps=10**6)
PER_SHARD = 10


def _fill(store, shards: int, start: int = 0) -> None:
    for chunk in range(start, start + shards):
        store.commit("gen", "w0", chunk, list(synthetic_groups(PER_SHARD, start=chunk * PER_SHARD, group_size=4, seq_len=64)),
                     row_group_groups=16)


async def _serve(root: str, state: Path, groups: int, writer) -> tuple[float, float, float]:
    """(start-up s until every group is queued, follow latency s of one new commit, one warm poll s)."""
    config = ServeConfig(store_root=root, state_path=str(state), follow_runs=["gen"], follow_interval_s=0.05)
    started = time.perf_counter()
    service = BatchService(config)
    await service.start()
    while service.queue.groups < groups:
        await asyncio.sleep(0.005)
    startup = time.perf_counter() - started
    poll_started = time.perf_counter()
    await asyncio.to_thread(service._scan)
    poll = time.perf_counter() - poll_started
    committed = time.perf_counter()
    await asyncio.to_thread(writer.commit, "gen", "w1", int(time.time() * 1000) % 10**8,
                            list(synthetic_groups(PER_SHARD, start=10**7, group_size=4, seq_len=64)))
    while service.queue.groups < groups + PER_SHARD:
        await asyncio.sleep(0.005)
    follow = time.perf_counter() - committed
    await service.stop()
    return startup, follow, poll


def _export(store) -> float:
    started = time.perf_counter()
    rows = sum(batch.num_rows for batch in open_store(store).iter_batches("gen"))
    assert rows > 0
    return time.perf_counter() - started


def measure(root: str, tmp: Path, shards: int) -> dict[str, float]:
    store = open_store(root)
    _fill(store, shards)
    out: dict[str, float] = {}
    for when in ("before", "after"):
        if when == "after":
            started = time.perf_counter()
            report = compact_store_run(open_store(root), "gen", target_bytes=256 << 20, flush=True)
            out["compact MB/s"] = report.bytes_in / 1e6 / (time.perf_counter() - started)
        groups = open_store(root).count("gen")
        state = tmp / f"state-{when}.sqlite"
        startup, follow, poll = asyncio.run(_serve(root, state, groups, open_store(root)))
        out[f"start-up s ({when})"] = startup
        out[f"follow s ({when})"] = follow
        out[f"warm poll ms ({when})"] = poll * 1000
        out[f"export s ({when})"] = _export(root)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shards, args.rounds = 40, 1
    server, endpoint = start_local_s3()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint)
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(endpoint_override=endpoint.split("://")[1], scheme="http", region="us-east-1",
                           access_key="bench", secret_key="bench", allow_bucket_creation=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-object-store-"))
    results: dict[str, list[dict[str, float]]] = {"local": [], "s3": []}
    try:
        for round_ in range(args.rounds):
            for label in ("local", "s3"):
                work = tmp / f"{label}-{round_}"
                work.mkdir()
                if label == "s3":
                    fs.create_dir(f"bench-{round_}")
                    root = f"s3://bench-{round_}/store"
                else:
                    root = str(ShardStore(work / "store").root)
                results[label].append(measure(root, work, args.shards))
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.shards} shards x {PER_SHARD} groups (4 x 64 tokens), {args.rounds} round(s), local then s3 (moto) "
          f"each round; load average {os.getloadavg()[0]:.1f}")
    print("| measure | local (each round) | s3 on moto (each round) |")
    print("|---|---|---|")
    for key in results["local"][0]:
        cells = [", ".join(f"{r[key]:.3g}" for r in results[label]) for label in ("local", "s3")]
        print(f"| {key} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
