"""Boundary-fill probe: fill the store's disk to its last pages, write, free space, retry; count what was lost or doubled.

Two targets:
  api    run-api (a child process) on a small tmpfs, posting groups with an Idempotency-Key, retrying every 503
         once space is freed, pulling /batch as a trainer, and killing run-api with SIGKILL every few cycles.
  store  ShardStore.commit directly: on a small tmpfs, or (without root) under a byte quota injected
         into the store's writes (`inject.Plan(quota=...)`), which cuts writes short exactly as a full disk does.

Each cycle fills the disk (a ballast file grown until ENOSPC, then shrunk by a random few pages), writes,
then frees space and retries what failed. At the end it checks: every acknowledged group stored exactly
once, glob readers (`shards/*.parquet`) see exactly the committed groups, no group served twice, `verify`
clean. Prints one JSON line; exit status 1 if anything was lost or doubled.

    python -m bench.store_faults.probe --target api --cycles 1000
    python -m bench.store_faults.probe --target store --cycles 1000 --quota   # no root needed
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SLACK_PAGES = [0, 0, 1, 2, 3, 5, 8, 16, 32, 64]
"""Free pages left after a fill: mostly the last few, where writes tear."""


@contextlib.contextmanager
def small_tmpfs(size_mb: int) -> Iterator[Path]:
    """A tmpfs of `size_mb` mounted on a fresh directory (needs root / CAP_SYS_ADMIN); unmounted after."""
    path = Path(tempfile.mkdtemp(prefix="store-probe-"))
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        path.rmdir()
        raise PermissionError(f"cannot mount a tmpfs on {path}: {result.stderr.strip() or result.returncode} (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        with contextlib.suppress(OSError):
            path.rmdir()


def can_mount_tmpfs() -> bool:
    try:
        with small_tmpfs(1):
            return True
    except (PermissionError, OSError):
        return False


class Ballast:
    """A file that takes up all free space but a few pages, and gives some back on request."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        self.size = 0

    def fill(self, slack_pages: int) -> None:
        block = b"\0" * (1 << 20)
        os.lseek(self.fd, self.size, os.SEEK_SET)
        while True:
            try:
                written = os.write(self.fd, block)
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                break
            self.size += written
            if written < len(block):
                block = block[:4096]  # the last pages, one at a time
        page = 4096
        self.size = max(0, (self.size // page - slack_pages) * page)
        os.ftruncate(self.fd, self.size)

    def free(self, mb: int = 4) -> None:
        self.size = max(0, self.size - (mb << 20))
        os.ftruncate(self.fd, self.size)

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


# ---- target: ShardStore.commit ----

def probe_store(root: Path, cycles: int, *, quota: bool, seed: int = 0, ballast: Ballast | None = None) -> dict[str, Any]:
    from bench.store_faults.inject import Plan, inject
    from factory.store import ShardStore, StoreError
    from factory.synthetic import synthetic_groups

    rng = random.Random(seed)
    acknowledged: Counter[str] = Counter()
    failures = Counter()
    store = ShardStore(root)

    def commit(chunk: int) -> bool:
        groups = list(synthetic_groups(3, start=3 * chunk, group_size=2, seq_len=32, seed=seed))
        try:
            record = store.commit("probe", "w0", chunk, groups)
        except (StoreError, OSError) as error:  # OSError: the store before StoreError named the path
            failures[(getattr(error, "errno", None) and errno.errorcode.get(error.errno)) or "other"] += 1
            return False
        if not record.skipped:
            acknowledged.update(g.group_id for g in groups)
        return True

    commit(0)
    record = store.committed("probe")["w0-00000000.parquet"]
    for cycle in range(1, cycles):
        if quota:
            # Anywhere in the shard, or (half the time) around the commit record: the bytes where the log tears.
            line = len(record.to_line())
            plan = Plan(quota=rng.randint(0, record.bytes) if rng.random() < 0.5 else rng.randint(record.bytes - 20, record.bytes + 2 * line))
            with inject(plan):
                ok = commit(cycle)
        else:
            assert ballast is not None
            ballast.fill(rng.choice(SLACK_PAGES))
            ok = commit(cycle)
            ballast.free()
        if not ok:
            if rng.random() < 0.3:
                store = ShardStore(root)  # a restart before the rerun
            commit(cycle)  # the rerun, with space freed
    return check_store(ShardStore(root), "probe", acknowledged) | {"failed_commits": dict(failures)}


def check_store(store: Any, run_id: str, acknowledged: Counter[str]) -> dict[str, Any]:
    import polars as pl

    stored = Counter(g for batch in store.iter_batches(run_id, columns=["group_id"]) for g in batch.column(0).to_pylist())
    pattern = str(store.shards_dir(run_id) / "*.parquet")
    globbed = Counter(pl.scan_parquet(pattern).select("group_id").collect()["group_id"].to_list()) if stored else Counter()
    return {
        "acknowledged": len(acknowledged),
        "stored": sum(stored.values()),
        "lost": len(set(acknowledged) - set(stored)),
        "stored_twice": sum(1 for c in stored.values() if c > 1),
        "glob_rows": sum(globbed.values()),
        "glob_differs": globbed != stored,
        "count_differs": store.count(run_id) != sum(stored.values()),
        "verify": [f"{p.kind}: {p.path}" for p in store.verify(run_id)],
        "leftover_tmp": len(list(store.run_dir(run_id).rglob("*.tmp"))),
    }


# ---- target: run-api ----

def probe_api(root: Path, cycles: int, ballast: Ballast, *, seed: int = 0, restart_every: int = 25) -> dict[str, Any]:
    import httpx
    import orjson

    from factory.serve.client import ApiProcess
    from factory.store import ShardStore
    from factory.synthetic import synthetic_groups
    from tests.conftest import free_port

    rng = random.Random(seed)
    port = free_port()
    command = [sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1", "--store_root",
               str(root / "store"), "--log_level", "error", "--follow_interval_s", "0.2", "--batch_metadata", "true"]
    log_path = Path(tempfile.gettempdir()) / f"store-probe-api-{port}.log"
    api = ApiProcess(command, port, log_path=str(log_path)).start()
    http = httpx.Client(base_url=api.url, timeout=30)
    registration = dict(wandb_group="g", wandb_project="p", batch_size=8, max_token_len=4096, checkpoint_dir="c",
                        save_checkpoint_interval=-1, starting_step=0, num_steps=10**6)
    http.post("/register", json=registration).raise_for_status()
    acknowledged: Counter[str] = Counter()
    served: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    unexpected: list[str] = []

    def post(cycle: int, index: int) -> bool:
        groups = [g.wire_dict() for g in synthetic_groups(2, start=2 * (4 * cycle + index), group_size=2, seq_len=64, seed=seed)]
        for group in groups:
            group.pop("group_id", None)
        key = f"c{cycle}-{index}"
        try:
            response = http.post("/scored_data_list", content=orjson.dumps(groups), headers={"Idempotency-Key": key,
                                                                                             "Content-Type": "application/json"})
        except httpx.TransportError as error:
            statuses["transport-error"] += 1
            unexpected.append(f"{key}: {type(error).__name__}")
            return False
        statuses[str(response.status_code)] += 1
        if response.status_code == 200:
            acknowledged.update(f"{key}:{i}" for i in range(len(groups)))
            return True
        if response.status_code != 503 or "retry-after" not in response.headers:
            unexpected.append(f"{key}: {response.status_code} {response.text[:200]}")
        return False

    def pull() -> None:
        try:
            response = http.get("/batch")
        except httpx.TransportError as error:
            statuses["batch-transport-error"] += 1
            unexpected.append(f"/batch: {type(error).__name__}")
            return
        statuses[f"batch-{response.status_code}"] += 1
        if response.status_code == 200:
            batch = response.json().get("batch") or []
            served.update(group["group_id"] for group in batch)
        elif response.status_code != 503:
            unexpected.append(f"/batch: {response.status_code} {response.text[:200]}")

    restarts = 0
    for cycle in range(cycles):
        ballast.fill(rng.choice(SLACK_PAGES))
        failed = [index for index in range(4) if not post(cycle, index)]
        pull()
        ballast.free()
        for index in failed:
            for _ in range(50):
                if post(cycle, index):
                    break
                time.sleep(0.05)
            else:
                unexpected.append(f"c{cycle}-{index}: not stored after 50 retries with space freed")
        if rng.random() < 0.1:  # a client that never saw its 200 retries an acknowledged post
            post(cycle, 0)
        if cycle % restart_every == restart_every - 1:
            api.kill9()
            restarts += 1
            api.start()
    for _ in range(10 * cycles):
        before = sum(served.values())
        pull()
        if sum(served.values()) == before:
            break
    status = http.get("/status").json()
    http.close()
    api.stop()
    result = check_store(ShardStore(root / "store"), "api", acknowledged)
    return result | {
        "posts": dict(statuses),
        "restarts": restarts,
        "served": sum(served.values()),
        "served_twice": sum(1 for c in served.values() if c > 1),
        "served_unacknowledged": len(set(served) - set(acknowledged)),
        "queued_at_end": status.get("queue_size"),
        "unexpected": unexpected[:20],
        "unexpected_count": len(unexpected),
    }


def ok(result: dict[str, Any]) -> bool:
    return (result["lost"] == 0 and result["stored_twice"] == 0 and not result["glob_differs"] and not result["count_differs"]
            and not result["verify"] and result.get("served_twice", 0) == 0 and result.get("unexpected_count", 0) == 0
            and result.get("served_unacknowledged", 0) == 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=["api", "store"], default="api")
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--tmpfs-mb", type=int, default=64)
    parser.add_argument("--quota", action="store_true", help="store target: an injected byte quota instead of a tmpfs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.target == "store" and args.quota:
        with tempfile.TemporaryDirectory() as root:
            result = probe_store(Path(root), args.cycles, quota=True, seed=args.seed)
    else:
        with small_tmpfs(args.tmpfs_mb) as mount:
            ballast = Ballast(mount / "ballast")
            try:
                if args.target == "store":
                    result = probe_store(mount / "store", args.cycles, quota=False, seed=args.seed, ballast=ballast)
                else:
                    result = probe_api(mount, args.cycles, ballast, seed=args.seed)
            finally:
                ballast.close()
    result = {"target": args.target, "cycles": args.cycles, "quota": args.quota, "seconds": round(time.monotonic() - started, 1),
              **result, "ok": None}
    result["ok"] = ok(result)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
